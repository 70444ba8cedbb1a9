"""The gateway's body cap, on a real uvicorn-served gateway in front of a CPU engine: far over the cap
(chunked, declared, or both at once) is refused with 413 without the gateway holding the body; at the
cap a request is served."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest

from serving.config import GatewayConfig
from serving.gateway import Gateway, create_gateway_app, static_replicas
from serving.launch import ServerThread
from serving.telemetry import TelemetryEmitter

LIMIT = 4096
MIB = 1 << 20


@pytest.fixture
def gateway_url(one_engine, tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    emitter = TelemetryEmitter(None, tmp_path / "spool")
    cfg = GatewayConfig(max_body_bytes=LIMIT, max_prompt_chars=LIMIT)
    gateway = Gateway(static_replicas([one_engine.url], "v0"), emitter, cfg, "undertow-policy")
    with ServerThread(create_gateway_app(gateway)) as srv:
        yield srv.url


@contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Samples this process's RSS (the gateway serves from a thread of it) every 5 ms; yields a list whose
    one item is, afterwards, the peak growth over the starting RSS in bytes."""
    proc = psutil.Process()
    start = proc.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out = [0]
    try:
        yield out
    finally:
        done.set()
        thread.join()
        out[0] = peak[0] - start


def padded(body: dict, size: int) -> bytes:  # type: ignore[type-arg]
    """``body`` as JSON, padded with trailing spaces to exactly ``size`` bytes."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def raw_request(port: int, head: bytes, body: Iterator[bytes] = iter(())) -> bytes:
    """Send ``head`` and then ``body`` over a plain socket (stopping if the server stops reading); the
    status line and headers of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        try:
            for chunk in body:
                sock.sendall(chunk)
        except OSError:
            pass  # the server answered and closed while the body was still coming
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer


def metrics(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(url + "/gateway/metrics", timeout=10).json()  # type: ignore[no-any-return]


def test_a_chunked_body_far_over_the_cap_gets_413_without_being_held(gateway_url) -> None:  # type: ignore[no-untyped-def]
    def body(total: int) -> Iterator[bytes]:
        chunk = b" " * MIB
        for _ in range(total // MIB):
            yield chunk

    with peak_rss_growth() as grown:
        big = httpx.post(
            gateway_url + "/v1/completions",
            content=body(200 * MIB),
            headers={"content-type": "application/json"},
            timeout=120,
        )
    assert big.status_code == 413 and big.json()["error"]["type"] == "RequestTooLarge", big.text
    assert grown[0] < 32 * MIB, f"the gateway held {grown[0] / MIB:.0f} MiB of a 200 MiB body; it reads up to its cap"
    assert metrics(gateway_url)["errors"]["RequestTooLarge"] == 1


def test_a_small_declared_length_does_not_let_a_chunked_body_through(gateway_url) -> None:  # type: ignore[no-untyped-def]
    """Content-Length and Transfer-Encoding together: the chunks frame the body (HTTP/1.1), so it is
    counted as it comes, whatever the header claims."""
    port = int(gateway_url.rsplit(":", 1)[1])
    head = (
        b"POST /v1/signals HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    frame = b"%x\r\n%s\r\n" % (MIB, b" " * MIB)

    def chunks() -> Iterator[bytes]:
        yield b"1\r\n[\r\n"
        for _ in range(200):
            yield frame
        yield b"1\r\n]\r\n0\r\n\r\n"

    with peak_rss_growth() as grown:
        answer = raw_request(port, head, chunks())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert grown[0] < 32 * MIB, f"the gateway held {grown[0] / MIB:.0f} MiB of a 200 MiB body"


def test_a_declared_length_over_the_cap_is_refused_before_the_body(gateway_url) -> None:  # type: ignore[no-untyped-def]
    port = int(gateway_url.rsplit(":", 1)[1])
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (200 * MIB)
    )
    answer = raw_request(port, head)  # no byte of the body is sent: the answer comes anyway
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    resp = httpx.post(
        gateway_url + "/v1/completions",
        content=padded({"prompt": "def f", "max_tokens": 2}, LIMIT + 1),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 413 and "larger than the limit of 4096 bytes" in resp.json()["error"]["message"]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_at_the_cap_is_served(gateway_url, framing) -> None:  # type: ignore[no-untyped-def]
    body = padded({"prompt": "def f", "max_tokens": 2}, LIMIT)
    content = body if framing == "content-length" else iter([body[:1000], body[1000:]])
    resp = httpx.post(
        gateway_url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["session_id"]
    session_id = resp.json()["choices"][0]["session_id"]
    signal = padded({"type": "feedback.thumbs", "session_id": session_id, "payload": {"value": 1}}, LIMIT)
    sig = httpx.post(gateway_url + "/v1/signals", content=signal, timeout=30)
    assert sig.status_code == 202, sig.text


def test_every_method_is_capped(gateway_url) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.request("PUT", gateway_url + "/v1/completions", content=b" " * (LIMIT + 1), timeout=30)
    assert resp.status_code == 413
    assert httpx.get(gateway_url + "/health", timeout=10).status_code == 200
