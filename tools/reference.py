"""Greedy outputs of one plain vLLM instance (no connector): the reference that the
disaggregated path must match token for token.

    python -m kvpush.tools.reference --model DIR --requests in.json --out out.json

``in.json`` is a list of {"prompt_token_ids": [...], "max_tokens": n}; ``out.json``
the list of generated token id lists, in the same order.
"""

from __future__ import annotations

import argparse
import json

from kvpush.services.worker.engine import engine_kwargs
from kvpush.services.worker.engine_settings import EngineSettings
from kvpush.shared import settings


def run(model: str, requests: list[dict], max_model_len: int = settings.MAX_MODEL_LEN) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(EngineSettings(model=model, role=None, engine_id="reference", nats_url=None,
                                             max_model_len=max_model_len)))
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=r.get("ignore_eos", False))
              for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-model-len", type=int, default=settings.MAX_MODEL_LEN)
    args = parser.parse_args()
    with open(args.requests) as f:
        requests = json.load(f)
    result = run(args.model, requests, args.max_model_len)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
