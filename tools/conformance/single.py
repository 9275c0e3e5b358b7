"""The reference of the conformance run: one plain ``vllm serve`` of the model, started with
the engine arguments kvpush's own engines get (``engine_kwargs``), so that any difference
the run finds is the split's or the gateway's, never a setting's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvpush.services.launch.natsd import free_port
from kvpush.services.launch.stack import answers
from kvpush.services.worker.engine import engine_kwargs
from kvpush.services.worker.engine_settings import EngineSettings

# What ``vllm serve`` needs beyond the engine's arguments: usage's cached_tokens, and tool
# calls in the built models' chat template's format (Hermes-style: vLLM's hermes parser).
SERVE_ONLY = ["--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def serve_flags(kwargs: dict) -> list[str]:
    """``vllm serve``'s command-line flags for vLLM engine keyword arguments."""
    flags = []
    for name, value in kwargs.items():
        if name == "model" or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif hasattr(value, "__dataclass_fields__") or hasattr(value, "model_dump"):  # a vLLM config object
            fields = {k: getattr(value, k) for k in ("backend", "disable_any_whitespace")}
            flags += [flag, json.dumps(fields)]
        elif isinstance(value, list):  # nargs "+" (--logits-processors)
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


class SingleVllm:
    """``vllm serve`` of ``model`` on a free port of this machine, as a context manager."""

    def __init__(self, model: str, max_model_len: int, log: Path, json_whitespace: str = "any"):
        settings = EngineSettings(model=model, role=None, engine_id="conformance-reference", nats_url=None,
                                  max_model_len=max_model_len, json_whitespace=json_whitespace)
        self.port = free_port()
        self.served_model_name = Path(model).name
        self.command = [sys.executable, "-m", "kvpush.tools.bench.vllm_cli", "serve", model, "--host", "127.0.0.1",
                        "--port", str(self.port), "--served-model-name", self.served_model_name,
                        *serve_flags(engine_kwargs(settings)), *SERVE_ONLY]
        self.log = log
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "SingleVllm":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(self.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not answers(self.url + "/health"):
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.process.returncode}: see {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not answer within {timeout:.0f} s: see {self.log}")
            time.sleep(1.0)

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
