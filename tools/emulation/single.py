"""One aggregated vLLM instance on the timed model, in this process: what the calibration
compares with a published single-instance figure, and what CI's tiny point runs.

``python -m kvpush.tools.emulation.single --profile timed-llama-3.1-8b --dilation 20
--input-len 32 --output-len 128 --batch 8`` builds the profile's folder (offline), starts
vLLM on it (one worker in this process, as kvpush's engines run), sends ``batch`` prompts of
``input-len`` tokens at once and prints, as JSON, the emulated TTFT (the first step's time)
and end-to-end latency (real seconds divided by k), and the tokens generated.

``--corrupt-check`` (a stand-in profile) also proves that the output depends on the KV it
reads: one prompt three times with prefix caching on, the second reading the first's cached
blocks (the same tokens), the third after the first cached block's read value was changed
in layer 0 (other tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvpush.services.launch.model import build_model, default_model_dir


def prompt_tokens(index: int, length: int, vocab: int = 4096) -> list[int]:
    """Tokens of prompt ``index``: a fixed walk over the vocabulary, different per prompt so
    that no two share a prefix (prefix caching is off anyway)."""
    return [10 + (index * 7919 + position * 104_729) % (vocab - 20) for position in range(length)]


def corrupt_first_block(worker) -> int:
    """On the engine's worker: change the value the stand-in reads of block 1 (the first block
    a fresh engine hands out; block 0 is vLLM's null block) in layer 0."""
    cache = worker.model_runner.kv_caches[0]
    cache[1].view(-1)[0] += 1.0
    return 1


def run(profile: str, dilation: float, input_len: int, output_len: int, batch: int,
        log_path: str | None = None, repeats: int = 1, block_size: int | None = None,
        corrupt_check: bool = False) -> dict:
    os.environ["KVPUSH_EMULATION_DILATION"] = str(dilation)
    if log_path:
        os.environ["KVPUSH_EMULATION_LOG"] = log_path
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, as kvpush's engines
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    folder = build_model(default_model_dir(profile), profile=profile)
    llm = LLM(model=str(folder), tokenizer=str(folder), dtype="float32", enforce_eager=True,
              max_model_len=input_len + output_len + 16, enable_prefix_caching=corrupt_check,
              distributed_executor_backend="uni", max_num_batched_tokens=max(2048, input_len * batch),
              block_size=block_size)
    result = {"profile": profile, "dilation": dilation, "input_len": input_len, "output_len": output_len,
              "batch": batch}
    if corrupt_check:  # before anything else, so that the prompt's first block is block 1
        prompt = [{"prompt_token_ids": prompt_tokens(batch, input_len)}]
        greedy = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
        first, again = (list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids) for _ in "12")
        llm.collective_rpc(corrupt_first_block)
        corrupted = list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        result["corrupt_check"] = {"first": first, "from_cache": again, "after_corruption": corrupted}
    prompts = [{"prompt_token_ids": prompt_tokens(i, input_len)} for i in range(batch)]
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        first = time.perf_counter() - started
        started = time.perf_counter()
        outputs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0),
                               use_tqdm=False)
        whole = time.perf_counter() - started
        runs.append({"ttft_s": first / dilation, "latency_s": whole / dilation,
                     "tokens": [list(out.outputs[0].token_ids) for out in outputs]})
    return {**result, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.tools.emulation.single")
    parser.add_argument("--profile", default="timed-llama-3.1-8b")
    parser.add_argument("--dilation", type=float, default=20.0)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--log", help="append each forward's record here (JSON lines)")
    parser.add_argument("--block-size", type=int, help="tokens per KV block (default: vLLM's)")
    parser.add_argument("--corrupt-check", action="store_true",
                        help="first: one prompt thrice, from its cache, the third after one block was changed")
    args = parser.parse_args(argv)
    result = run(args.profile, args.dilation, args.input_len, args.output_len, args.batch, args.log, args.repeats,
                 args.block_size, args.corrupt_check)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
