"""A private Docker engine: Debian's dockerd (docker.io, 20.10) started as root with its own
socket, data root, exec root and pidfile under one folder, addresses only from
198.19.0.0/16, no iptables rules; stopped by its process id, with what it leaves behind
(bridge links, mounts, its containerd) removed.

    with PrivateEngine(Path("/tmp/x")) as engine:
        subprocess.run(["docker", "ps"], env=engine.env())
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# 198.19.0.0/16 only: never a private range, never 198.18.0.0/16 (the multi-host rig's).
BRIDGE_IP = "198.19.0.1/24"
ADDRESS_POOL = "base=198.19.0.0/16,size=24"
STORAGE_DRIVERS = ("overlay2", "vfs")  # overlay2 when the kernel takes it: vfs copies every layer whole
# A unix socket's path holds at most 107 bytes; containerd's deepest is this under the folder.
DEEPEST_SOCKET = "exec/containerd/containerd.sock.ttrpc"
# Folders dockerd, containerd and runc make at fixed places whatever their roots (plugin
# sockets, shim sockets, runc's state for builds): removed again when empty and new.
RUNTIME_FOLDERS = ("/run/docker/plugins", "/run/docker", "/run/containerd/s", "/run/containerd", "/run/runc")


class EngineError(RuntimeError):
    """No Docker engine could start here (the compose check fails: it is never skipped)."""


def links() -> set[str]:
    """Names of this host's network links."""
    return {name for name in os.listdir("/sys/class/net")}


def _docker_links(names: set[str]) -> set[str]:
    return {n for n in names if n == "docker0" or n.startswith("br-")}


def _mounts_under(folder: Path) -> list[str]:
    prefix = str(folder) + "/"
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target.startswith(prefix) or target == str(folder):
                found.append(target)
    return found


def unmount_under(folder: Path) -> list[str]:
    """Unmount whatever is mounted at or under ``folder`` (deepest first); return what is
    still mounted there."""
    for target in sorted(_mounts_under(folder), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
    return _mounts_under(folder)


def remove_folder(folder: Path) -> bool:
    """Remove ``folder`` once nothing is mounted under it (an engine's overlays, a killed
    debootstrap's /proc and /sys): never a tree with a host file system inside. True if gone."""
    folder = Path(folder)
    if not folder.exists():
        return True
    if unmount_under(folder):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def _processes_mentioning(text: str) -> list[int]:
    """Processes whose command line names ``text`` (the engine's folder): its dockerd,
    containerd and shims, which all take a path under it."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 5.0):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


class PrivateEngine:
    """dockerd under ``folder`` (created, and removed by :meth:`stop`)."""

    def __init__(self, folder: Path, dockerd: str = "dockerd", start_timeout: float = 60.0):
        self.folder = Path(folder)
        self.dockerd = dockerd
        self.start_timeout = start_timeout
        self.socket = self.folder / "docker.sock"
        self.pidfile = self.folder / "docker.pid"
        self.storage_driver: str | None = None
        self.pid: int | None = None
        self.attempts: list[str] = []  # what each storage driver said when it did not start
        self._links_before: set[str] | None = None  # None: never started, so no link is ours
        self._runtime_before: set[str] | None = None

    # -- starting ---------------------------------------------------------------------

    def preflight(self) -> None:
        """Raise EngineError with what to do when no engine can start here."""
        if shutil.which(self.dockerd) is None:
            raise EngineError(f"no Docker engine: {self.dockerd!r} is not installed. Install Debian's engine "
                              "(as root: apt-get install docker.io) and run the compose check as root.")
        if os.geteuid() != 0:
            raise EngineError("no Docker engine: dockerd needs root (its bridge, mounts and cgroups); "
                              "run the compose check as root.")
        deepest = self.folder.resolve() / DEEPEST_SOCKET
        if len(str(deepest).encode()) > 107:
            raise EngineError(f"no Docker engine: its folder {self.folder} is too deep for a unix socket path "
                              f"({deepest}, over 107 bytes); use a shorter one (e.g. under /tmp).")

    def start(self) -> "PrivateEngine":
        self.preflight()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._links_before = links()
        self._runtime_before = {f for f in RUNTIME_FOLDERS if os.path.exists(f)}
        for driver in STORAGE_DRIVERS:
            if self._start_with(driver):
                self.storage_driver = driver
                return self
        self.stop()
        raise EngineError("no Docker engine could start here:\n" + "\n".join(self.attempts))

    def _start_with(self, driver: str) -> bool:
        data_root = self.folder / f"data-{driver}"
        log = self.folder / f"dockerd-{driver}.log"
        argv = [
            self.dockerd,
            "--host", f"unix://{self.socket}",
            "--data-root", str(data_root),
            "--exec-root", str(self.folder / "exec"),
            "--pidfile", str(self.pidfile),
            "--config-file", str(self._config()),  # not the host's /etc/docker/daemon.json
            "--storage-driver", driver,
            "--iptables=false", "--ip6tables=false",
            "--bip", BRIDGE_IP,
            "--default-address-pool", ADDRESS_POOL,
            # its own containerd namespaces: nothing shared with any other engine's
            "--containerd-namespace", "kvpush-check",
            "--containerd-plugins-namespace", "kvpush-check-plugins",
        ]
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        self.pid = process.pid
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            if self.ping():
                info = self.api_json("/info")
                if info.get("Driver") == driver:
                    return True
                break
            time.sleep(0.2)
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        self.attempts.append(f"  --storage-driver={driver}: " + (" | ".join(tail) or "no output"))
        self._stop_process()
        shutil.rmtree(data_root, ignore_errors=True)
        return False

    def _config(self) -> Path:
        """Its daemon.json: the engine's ID key here too (20.10 writes /etc/docker/key.json
        otherwise; the setting has no flag)."""
        import json

        path = self.folder / "daemon.json"
        path.write_text(json.dumps({"deprecated-key-path": str(self.folder / "key.json")}))
        return path

    # -- talking to it ----------------------------------------------------------------

    def env(self, base: dict | None = None) -> dict:
        """An environment whose Docker clients (docker, compose) talk to this engine only."""
        env = dict(os.environ if base is None else base)
        for key in ("DOCKER_CONTEXT", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_API_VERSION"):
            env.pop(key, None)
        config = self.folder / "client-config"  # no user config, credential helpers or contexts
        config.mkdir(parents=True, exist_ok=True)
        env.update(DOCKER_HOST=f"unix://{self.socket}", DOCKER_CONFIG=str(config))
        return env

    def api(self, method: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = _UnixHTTPConnection(str(self.socket), timeout=timeout)
        try:
            conn.request(method, path)
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def api_json(self, path: str):
        import json

        status, body = self.api("GET", path)
        if status != 200:
            raise EngineError(f"GET {path}: {status} {body[:200]!r}")
        return json.loads(body)

    def ping(self) -> bool:
        try:
            return self.api("GET", "/_ping", timeout=2.0) == (200, b"OK")
        except OSError:
            return False

    def version(self) -> dict:
        return self.api_json("/version")

    # -- stopping ---------------------------------------------------------------------

    def _stop_process(self, timeout: float = 30.0) -> None:
        pid = self.pid
        try:
            pid = int(self.pidfile.read_text().strip())  # the engine's own word, when it wrote one
        except (OSError, ValueError):
            pass
        if pid is None:
            return
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)  # ours: reap it
        except ChildProcessError:
            pass
        self.pid = None

    def _new_links(self) -> set[str]:
        """docker0 and br-* links that appeared since this engine started (it made them)."""
        if self._links_before is None:
            return set()
        return _docker_links(links()) - self._links_before

    def leftovers(self) -> dict:
        """What of this engine is still on the host (all empty once stopped)."""
        return {
            "processes": _processes_mentioning(str(self.folder)),
            "links": sorted(self._new_links()),
            "mounts": _mounts_under(self.folder),
        }

    def stop(self, remove: bool = True) -> dict:
        """Stop dockerd by its pid, then remove its containerd and shims (by pid, each one
        naming this folder), its bridge links (docker0, br-*: the engine leaves them), its
        mounts and the folder. Returns :meth:`leftovers` as they were just before the folder
        went (all empty when everything went)."""
        self._stop_process()
        for pid in _processes_mentioning(str(self.folder)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _processes_mentioning(str(self.folder)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in sorted(self._new_links()):
            subprocess.run(["ip", "link", "delete", name], capture_output=True)
        unmount_under(self.folder)
        for folder in RUNTIME_FOLDERS if self._runtime_before is not None else ():
            if folder not in self._runtime_before:
                with contextlib.suppress(OSError):  # only an empty one: rmdir, never a tree
                    os.rmdir(folder)
        left = self.leftovers()
        if remove:
            remove_folder(self.folder)
        return left

    def __enter__(self) -> "PrivateEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
