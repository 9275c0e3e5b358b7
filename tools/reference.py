"""Outputs of one plain vLLM instance (no connector): the reference that the
disaggregated path must match token for token. Greedy unless a request says otherwise.

    python -m kvpush.tools.reference --model DIR --requests in.json --out out.json [--tensor-parallel-size N]

``in.json`` is a list of {"prompt_token_ids": [...], "max_tokens": n, ...}, where ``...``
is any more of vLLM's SamplingParams, by its own names (``temperature``, ``top_p``,
``seed``, ``n``, ...); ``out.json`` the list of generated token id lists, in the same order
(a request with ``n`` > 1: the list of its n answers' lists, by index), and
where a request asked for ``logprobs``, ``out.json.logprobs.json`` each position's
candidates as [token id, logprob], in the engine's order (null for the others).
"""

from __future__ import annotations

import argparse
import json

from kvpush.services.worker.engine import engine_kwargs, rank_binding
from kvpush.services.worker.engine_settings import EngineSettings
from kvpush.shared import settings


def run(model: str, requests: list[dict], max_model_len: int = settings.MAX_MODEL_LEN,
        tensor_parallel_size: int = 1) -> tuple[list, list]:
    """At TP above 1 the engine's ranks are bound to this process's cores as a kvpush
    worker's are (``engine.rank_binding``), unless the environment names a binding."""
    from vllm import LLM, SamplingParams

    with rank_binding(tensor_parallel_size):
        llm = LLM(**engine_kwargs(EngineSettings(model=model, role=None, engine_id="reference", nats_url=None,
                                                 max_model_len=max_model_len,
                                                 tensor_parallel_size=tensor_parallel_size)))
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r.get("temperature", 0.0),
                             ignore_eos=r.get("ignore_eos", False),
                             **{k: v for k, v in r.items() if k not in ("prompt_token_ids", "max_tokens",
                                                                         "temperature", "ignore_eos")})
              for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) if len(o.outputs) == 1
              else [list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]
    return tokens, [_logprobs(o.outputs[0].logprobs) for o in outputs]


def _logprobs(positions) -> list[list[list]] | None:
    """Each position's candidates, in the engine's order: [token id, logprob]."""
    if positions is None:
        return None
    return [[[token_id, lp.logprob] for token_id, lp in (position or {}).items()] for position in positions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-model-len", type=int, default=settings.MAX_MODEL_LEN)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    with open(args.requests) as f:
        requests = json.load(f)
    tokens, logprobs = run(args.model, requests, args.max_model_len, args.tensor_parallel_size)
    with open(args.out, "w") as f:
        json.dump(tokens, f)
    if any(entry is not None for entry in logprobs):
        with open(args.out + ".logprobs.json", "w") as f:
            json.dump(logprobs, f)


if __name__ == "__main__":
    main()
