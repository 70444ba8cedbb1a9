"""A network link between this host and a process in its own network namespace, for benchmarks.

The deployment benchmark puts the weight store across one, as a fleet's store sits across a
network from its replicas: a veth pair between the root namespace (``10.77.<n>.1``) and a new
namespace (``10.77.<n>.2``), both ends shaped by the kernel's token-bucket filter (``tc qdisc
... tbf``) to ``mbit`` megabits per second, so every byte a replica pulls crosses real TCP over
a link of that rate. Needs ``ip`` and ``tc`` (iproute2) and the right to create namespaces
(root or ``CAP_NET_ADMIN``); :func:`available` says whether this machine can, and why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A shaped link: ``host_ip`` here, ``peer_ip`` inside ``namespace``."""

    namespace: str
    host_ip: str
    peer_ip: str
    mbit: int

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def available() -> str | None:
    """``None`` when a link can be made here, else what is missing."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"utprobe{os.getpid() % 100000}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode:
        return f"cannot create a network namespace ({done.stderr.strip()}); run as root or with CAP_NET_ADMIN"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def shaped_link(mbit: int) -> Iterator[Link]:
    """Create the namespace and the shaped veth pair; remove both on exit."""
    tag = os.getpid() % 100000
    subnet = tag % 250 + 1
    link = Link(f"utstore{tag}", f"10.77.{subnet}.1", f"10.77.{subnet}.2", mbit)
    host_end, peer_end = f"uth{tag}", f"utp{tag}"
    _run(["ip", "netns", "add", link.namespace])
    try:
        _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", peer_end])
        _run(["ip", "link", "set", peer_end, "netns", link.namespace])
        _run(["ip", "addr", "add", f"{link.host_ip}/24", "dev", host_end])
        _run(["ip", "link", "set", host_end, "up"])
        inside = ["ip", "netns", "exec", link.namespace]
        _run([*inside, "ip", "addr", "add", f"{link.peer_ip}/24", "dev", peer_end])
        _run([*inside, "ip", "link", "set", peer_end, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        # Burst: at least one timer tick of bytes at this rate (HZ up to 1000) and a few full packets.
        burst = max(64 * 1024, mbit * 1_000_000 // 8 // 1000 * 2)
        shape = ["root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "20ms"]
        _run(["tc", "qdisc", "add", "dev", host_end, *shape])
        _run([*inside, "tc", "qdisc", "add", "dev", peer_end, *shape])
        yield link
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", link.namespace], capture_output=True)
