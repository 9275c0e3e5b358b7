"""One load point, driven by ``vllm bench serve``: the client every system gets.

Open-loop Poisson arrivals (``--request-rate``), vLLM's ``random`` dataset with a fixed
seed (so every system gets the same prompts), ``--ignore-eos`` with a fixed output length,
streaming ``/v1/completions`` through the OpenAI backend. The raw result file
(``--save-result --save-detailed``: every request's TTFT, ITLs, lengths and errors) is
kept as vLLM writes it; ``summary`` reads the figures the tables need out of it.

Each point's client is a process of its own, as ``vllm bench serve`` run from a shell: forked
from a forkserver that imported vLLM's CLI once (``vllm_client_preload``), so it does not
spend ten seconds importing vLLM before its first request.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Load:
    input_len: int
    output_len: int
    rate: float
    requests: int
    range_ratio: float = 0.0  # >0: prompt lengths uniform in input_len * [1 - r, 1 + r]
    seed: int = 0
    warmups: int = 2
    burstiness: float = 1.0  # arrival gaps from a gamma distribution: 1 is Poisson, lower is burstier
    # vLLM bench serve's own sampling flags (--temperature, --top-p, ...) as given; none:
    # its defaults, which send no sampling field (the server's defaults apply)
    sampling_flags: tuple[str, ...] = ()
    # Tokens every prompt shares at its start, counted in input_len (vLLM's --random-prefix-len,
    # which adds them to --random-input-len): the published push-vs-pull table's 50 of 512.
    prefix_len: int = 0


def command(base_url: str, model_name: str, tokenizer: str, load: Load, result_file: Path, request_id_prefix: str,
            extra_body: dict) -> list[str]:
    """The point's client as a command line (``vllm bench serve ...`` through vLLM's CLI shim)."""
    return [sys.executable, "-m", "kvpush.tools.bench.vllm_cli",
            *arguments(base_url, model_name, tokenizer, load, result_file, request_id_prefix, extra_body)]


def arguments(base_url: str, model_name: str, tokenizer: str, load: Load, result_file: Path, request_id_prefix: str,
              extra_body: dict) -> list[str]:
    """``vllm``'s arguments for the point: ``bench serve`` and its flags."""
    args = ["bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(load.input_len - load.prefix_len),
            "--random-prefix-len", str(load.prefix_len),
            "--random-output-len", str(load.output_len), "--random-range-ratio", str(load.range_ratio),
            "--num-prompts", str(load.requests), "--request-rate", str(load.rate), "--seed", str(load.seed),
            "--num-warmups", str(load.warmups), "--burstiness", str(load.burstiness),
            "--ignore-eos", "--save-result", "--save-detailed",
            "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--request-id-prefix", request_id_prefix, "--disable-tqdm"]
    if extra_body:
        args += ["--extra-body", json.dumps(extra_body)]
    return args + list(load.sampling_flags)


def run(base_url: str, model_name: str, tokenizer: str, load: Load, result_file: Path, request_id_prefix: str,
        extra_body: dict, timeout: float) -> dict:
    """Run the point; the result file's contents. Raises if the client itself failed."""
    result_file.parent.mkdir(parents=True, exist_ok=True)
    log = result_file.with_suffix(".log")
    client = _clients().Process(target=_client_process, name="vllm-bench-serve",
                                args=(arguments(base_url, model_name, tokenizer, load, result_file, request_id_prefix,
                                                extra_body), str(log)))
    client.start()
    client.join(timeout)
    if client.exitcode is None:  # killed: a system that stopped answering
        client.kill()
        client.join()
        raise TimeoutError(f"vllm bench serve gave no result within {timeout:g} s")
    if client.exitcode != 0 or not result_file.exists():
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"vllm bench serve exited with {client.exitcode}: {tail}")
    return json.loads(result_file.read_text())


_forkserver: multiprocessing.context.BaseContext | None = None
_forkserver_lock = threading.Lock()  # protects _forkserver: points may start from several threads


def _clients() -> multiprocessing.context.BaseContext:
    """Where each point's client is forked from: a forkserver that imported vLLM's CLI."""
    global _forkserver
    with _forkserver_lock:
        if _forkserver is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["kvpush.tools.bench.vllm_client_preload"])
            _forkserver = context
        return _forkserver


def _client_process(argv: list[str], log: str) -> None:
    """One point's ``vllm bench serve``, its output to ``log``; its exit code is vLLM's."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    from kvpush.tools.bench import vllm_cli

    vllm_cli.main(argv)


def summary(result: dict) -> dict:
    """TTFT / TPOT / ITL / E2E percentiles (ms), throughput and failures of one result file."""
    out = {
        "completed": result.get("completed", 0),
        "failed": result.get("failed", 0),
        "request_throughput": result.get("request_throughput", 0.0),
        "output_throughput": result.get("output_throughput", 0.0),
        "duration_s": result.get("duration", 0.0),
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        out[f"mean_{metric}_ms"] = result.get(f"mean_{metric}_ms")
        for p in PERCENTILES:
            out[f"p{p}_{metric}_ms"] = result.get(f"p{p}_{metric}_ms")
    return out
