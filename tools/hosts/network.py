"""Several "hosts" on one machine, for tests of what crosses a network: each host a network
namespace with one interface (``eth0``) and its own address in 198.18.0.0/24, all on one
switch (a bridge in a namespace of its own). The machine itself (the root namespace, where
the test runs) joins the switch as 198.18.0.254, the operator's laptop. Needs root and
iproute2; ``stop`` deletes every namespace, and with them every link it made.

Between two hosts, tc counts and cuts the traffic that is not NATS (ports 4222 and 6222):
on each host's ``eth0``, an htb class per watched peer that u32 filters send that traffic
to. Its byte counter says what the host sent the peer (NIXL's UCX-over-TCP bytes, when the
two are a prefill and a decode); replacing the class's queue with one of length zero drops
it all (the cut), while both hosts stay on NATS. htb, pfifo and u32 are what this machine's
kernel has: no netem, no tc actions, no iptables.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET_PREFIX = "198.18.0."  # 198.18.0.0/15 is for benchmarking networks (RFC 2544), never routed
PREFIX_LEN = 24
OPERATOR = 254  # the root namespace's address on the switch: 198.18.0.254
DEVICE = "eth0"  # each host's one interface
NATS_PORTS = (4222, 6222)  # client and cluster-route ports: never counted, never cut
UCX_ON_ETH0 = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # NIXL's bytes over the host's link: no shm, no CMA
QUEUE = 10_000  # packets a counting class queues (far more than a veth ever holds)


class NetworkError(RuntimeError):
    """The namespaces could not be made (not root, no iproute2, ...): said as a sentence."""


def run(*args: str, check: bool = True) -> str:
    done = subprocess.run(args, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    name: str
    netns: str
    number: int  # the last byte of its address
    watched: dict[str, int] = field(default_factory=dict)  # peer address -> its tc class minor

    @property
    def address(self) -> str:
        return f"{SUBNET_PREFIX}{self.number}"

    def exec_prefix(self) -> list[str]:
        """A command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, *args: str, check: bool = True) -> str:
        return run(*self.exec_prefix(), *args, check=check)

    def interface_bytes(self) -> dict[str, int]:
        """``eth0``'s counters: {"rx": bytes received, "tx": bytes sent}."""
        link = json.loads(run("ip", "-n", self.netns, "-j", "-s", "link", "show", "dev", DEVICE))[0]
        return {"rx": link["stats64"]["rx"]["bytes"], "tx": link["stats64"]["tx"]["bytes"]}

    def watch(self, peer: "Host") -> None:
        """Count (and make cuttable) what this host sends ``peer`` outside NATS."""
        tc = ["tc", "-n", self.netns]
        if not self.watched:
            run(*tc, "qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb", "default", "10")
            run(*tc, "class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit",
                "quantum", "60000")
            for port in NATS_PORTS:
                for direction in ("dport", "sport"):
                    run(*tc, "filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                        "match", "ip", "protocol", "6", "0xff", "match", "ip", direction, str(port), "0xffff",
                        "flowid", "1:10")
        minor = 100 + peer.number
        run(*tc, "class", "add", "dev", DEVICE, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", "10gbit",
            "quantum", "60000")
        self._queue(peer, minor, QUEUE, "add")
        run(*tc, "filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio", "10", "u32",
            "match", "ip", "dst", f"{peer.address}/32", "flowid", f"1:{minor}")
        self.watched[peer.address] = minor

    def bytes_to(self, peer: "Host") -> int:
        """Bytes this host sent ``peer`` outside NATS since ``watch`` (dropped ones included)."""
        return self._class_stats(peer)[0]

    def dropped_to(self, peer: "Host") -> int:
        """Packets to ``peer`` the cut dropped."""
        return self._class_stats(peer)[1]

    def _class_stats(self, peer: "Host") -> tuple[int, int]:
        # This tc prints no JSON for classes: "class htb 1:103 ...\n Sent 123 bytes 4 pkt (dropped 5, ..."
        minor = self.watched[peer.address]
        lines = run("tc", "-n", self.netns, "-s", "class", "show", "dev", DEVICE).splitlines()
        for i, line in enumerate(lines):
            if line.startswith(f"class htb 1:{minor} "):
                words = lines[i + 1].replace(",", " ").split()
                return int(words[words.index("Sent") + 1]), int(words[words.index("(dropped") + 1])
        raise NetworkError(f"no tc class 1:{minor} on {self.name}")

    def shape(self, peer: "Host", bits_per_s: int) -> None:
        """Limit what this host sends ``peer`` outside NATS to ``bits_per_s`` (htb rate and
        ceil; a veth shaped so carries it within a few percent, measured). Rate only: this
        kernel has no netem, so no latency can be added."""
        if peer.address not in self.watched:
            self.watch(peer)
        minor = self.watched[peer.address]
        run("tc", "-n", self.netns, "class", "change", "dev", DEVICE, "parent", "1:", "classid", f"1:{minor}",
            "htb", "rate", f"{int(bits_per_s)}bit", "ceil", f"{int(bits_per_s)}bit", "quantum", "60000")

    def cut(self, peer: "Host") -> None:
        """Drop everything this host sends ``peer`` outside NATS (a queue of length zero)."""
        self._queue(peer, self.watched[peer.address], 0, "replace")

    def mend(self, peer: "Host") -> None:
        self._queue(peer, self.watched[peer.address], QUEUE, "replace")

    def _queue(self, peer: "Host", minor: int, limit: int, verb: str) -> None:
        run("tc", "-n", self.netns, "qdisc", verb, "dev", DEVICE, "parent", f"1:{minor}", "handle", f"{minor}:",
            "pfifo", "limit", str(limit))


TAG_PREFIX = "kvp"  # a run's namespaces are kvp<pid>-<name>, its root-namespace link kvp<pid>op


def leftover_tags(namespaces: list[str], alive) -> set[str]:
    """The tags among ``namespaces`` whose process is gone (``alive(pid)`` says false): what a
    killed run left behind. Its operator link still holds 198.18.0.254/24 in the root namespace,
    and the kernel routes the subnet through the first such link, so a later run's monitor
    probes would reach a dead switch (seen in CI: "does not answer its monitor port")."""
    tags = set()
    for namespace in namespaces:
        tag, _, rest = namespace.partition("-")
        digits = tag[len(TAG_PREFIX):]
        if tag.startswith(TAG_PREFIX) and rest and digits.isdigit() and not alive(int(digits)):
            tags.add(tag)
    return tags


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> set[str]:
    """Delete what runs that were killed left (their namespaces and operator links); returns their tags."""
    names = [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]
    tags = leftover_tags(names, process_alive)
    for namespace in names:
        if namespace.partition("-")[0] in tags:
            for pid in run("ip", "netns", "pids", namespace, check=False).split():
                run("kill", "-9", pid, check=False)  # a nats-server or engine the killed run left
            run("ip", "netns", "delete", namespace, check=False)
    for tag in tags:
        run("ip", "link", "delete", f"{tag}op", check=False)
    return tags


class Network:
    """``with Network() as net: h1 = net.add_host("h1", 1)``; the names carry this process's
    id, so two runs on one machine do not meet, and a run that was killed is cleared away by
    the next one (``remove_leftovers``)."""

    def __init__(self, tag: str | None = None):
        self.tag = tag or f"{TAG_PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []

    def start(self) -> "Network":
        if os.geteuid() != 0:
            raise NetworkError("the multi-host rig makes network namespaces: run it as root (CI does)")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise NetworkError("the multi-host rig needs iproute2's `ip` and `tc` (apt-get install iproute2)")
        remove_leftovers()
        try:
            self._add_namespace(self.switch)
            run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.switch, "link", "set", "br0", "up")
            # The operator's end stays in the root namespace.
            outside, inside = f"{self.tag}op", f"{self.tag}opb"
            run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self._plug(inside)
            run("ip", "addr", "add", f"{SUBNET_PREFIX}{OPERATOR}/{PREFIX_LEN}", "dev", outside)
            run("ip", "link", "set", outside, "up")
        except BaseException:
            self.stop()
            raise
        return self

    def add_host(self, name: str, number: int) -> Host:
        netns = f"{self.tag}-{name}"
        self._add_namespace(netns)
        outside, inside = f"{self.tag}{name}", f"{self.tag}{name}b"
        run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        run("ip", "link", "set", outside, "netns", netns)
        run("ip", "-n", netns, "link", "set", outside, "name", DEVICE)
        self._plug(inside)
        run("ip", "-n", netns, "addr", "add", f"{SUBNET_PREFIX}{number}/{PREFIX_LEN}", "dev", DEVICE)
        for device in (DEVICE, "lo"):
            run("ip", "-n", netns, "link", "set", device, "up")
        host = self.hosts[name] = Host(name, netns, number)
        return host

    def stop(self) -> None:
        for netns in reversed(self._namespaces):
            run("ip", "netns", "delete", netns, check=False)  # its links go with it, peers too
        self._namespaces.clear()
        run("ip", "link", "delete", f"{self.tag}op", check=False)

    def _add_namespace(self, netns: str) -> None:
        run("ip", "netns", "delete", netns, check=False)  # left by a run that was killed
        run("ip", "netns", "add", netns)
        self._namespaces.append(netns)

    def _plug(self, device: str) -> None:
        run("ip", "link", "set", device, "netns", self.switch)
        run("ip", "-n", self.switch, "link", "set", device, "master", "br0")
        run("ip", "-n", self.switch, "link", "set", device, "up")

    def __enter__(self) -> "Network":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
