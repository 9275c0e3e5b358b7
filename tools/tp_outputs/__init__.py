"""Outputs across tensor-parallel sizes (issue 44): 20 prompts of 1 to 1800 tokens, greedy
and seeded, through kvpush in push, pull and local at each pair of prefill and decode TP
(P TP2 / D TP2, P TP2 -> D TP1, P TP1 -> D TP2), each output compared token for token with a
single plain vLLM engine at the prefill's TP and at the decode's TP.

    python -m kvpush.tools.tp_outputs --out tp-outputs [--combos 2x2,2x1,1x2] [--modes push,pull,local]

``compare``: the pure judgement of one output against the references (equal to one, a near
tie where it departs, or different); ``run``: the references, the stacks and the requests,
and the JSON it writes. docs/benchmarks.md ("Outputs across tensor-parallel sizes") has a run.
"""
