"""Gateway overhead on streamed answers: the same streamed chat request sent straight to a CPU
engine (the baseline) and through the user-facing gateway (the project), side by side in one run.

Setup: one CPU engine replica (``undertow engine serve``, one torch thread) serving a fresh
``tiny`` policy (about 0.7M parameters, tokenizer trained here), and the gateway
(:class:`serving.gateway.Gateway` over that replica, in this process under uvicorn on a thread,
as the tests and ``benchmarks/deploy.py`` run it). The gateway runs with a real
:class:`serving.telemetry.TelemetryEmitter` whose producer factory is None: each served choice is
built into a ``session.completed`` event by the gateway (after relaying ``[DONE]``, before ending
the response) and spooled to a temporary directory by the emitter's background thread, so the
per-request telemetry cost is included (in ``end_ms_*`` and in the CPU the gateway takes from
the shared cores; the user sees ``[DONE]`` before it).

Request: ``POST /v1/chat/completions`` with ``stream: true``, ``temperature`` 0 and a fixed
``seed`` (both paths generate the same tokens; checked: same text and token count in every pair),
``max_tokens`` 64 (``--tokens``), a stop string that never occurs (the length is fixed by
``max_tokens``: every stream must finish with ``length``; the prompt is picked at start among a
few so that greedy decoding does not reach EOS first) and ``stream_options.include_usage`` (the
token count). Both paths use one persistent ``httpx`` client (HTTP/1.1 keep-alive, a connection
to each server), timed client side: TTFT is from sending the request to receiving the first
chunk whose delta has content (the role-only opening chunk does not count); the stream time is
from sending to receiving ``data: [DONE]``; the arrival of every content chunk is recorded, and
the end of the response (the client reads every response to its end, keeping the connection).

Method: a warm-up (``--warmup`` rounds, default 5) is discarded, then ``--iterations`` rounds
(default 30). A round sends the request once by each path back to back, the order going
through every permutation of the paths in turn, so drift, load changes and position hit every
path alike. By default a third path runs in each round as well (``--no-split`` drops it): the
request the gateway itself sends to the engine (``logprobs``, ``return_token_ids``,
``stream_options``), sent straight to the engine. It splits the overhead into the engine's
extra work for the gateway's extras (token ids, logprobs, re-scored logprobs and routed experts
on the last chunk) and the relay itself (the second HTTP hop, parsing, rewriting and
re-serialising every chunk).

Fields:
- ``ttft_ms_direct``, ``ttft_ms_gateway``: p50 over rounds of each path's TTFT (``_p90``: p90).
- ``overhead_p50_ms``: p50 over rounds of the paired difference (gateway TTFT minus direct TTFT
  of the same round), not the difference of the p50s (which is reported as
  ``overhead_ms_p50_difference``); ``overhead_p90_ms``: p90 of the paired differences.
- ``stream_overhead_per_token_ms``: per round, (gateway stream time - direct stream time - TTFT
  difference) / (tokens - 1), i.e. the extra time between the first content chunk and
  ``[DONE]`` spread over the tokens after the first; p50 over rounds (``_p90``: p90).
- ``stream_ms_*``, ``inter_chunk_ms_*``, ``end_ms_*``: p50 of stream times, of the gaps between
  content chunks and of the time from ``[DONE]`` to the end of the response, per path.
- ``split``: the same statistics for ``engine_extras`` (direct with the gateway's body minus
  direct) and ``relay`` (gateway minus direct with the gateway's body).
- ``engine_connections_opened``: TCP connections opened to the engine during the rounds (local
  ports connected to its loopback port, open or in TIME_WAIT, from ``psutil``; a lower bound, as
  the kernel may reuse a port in TIME_WAIT). The client's own connection is opened before, so 1
  means the gateway keeps its engine connection alive across streams, and about one per gateway
  stream (``gateway_streams``) means it reconnects for each.
- ``tokens_per_stream``, ``iterations``, ``warmup``, ``meets_targets`` (``overhead_p50_ms`` <= 5
  and ``stream_overhead_per_token_ms`` <= 1), ``telemetry`` (the emitter's counters: one event
  per gateway stream), and the conditions: the model, CPUs, torch threads, load average.

The engine, the gateway and the client share the machine (2 cores here): the gateway's CPU work
competes with the engine's sampling thread and with the client, as it would on a shared host.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


MODEL_NAME = "undertow-policy"
STOP = "\x07\x07never\x07\x07"
"""A stop string the tiny model does not produce (checked: every stream finishes with ``length``)."""
PROMPTS = [
    "Write a function that adds two numbers.",
    "def add(a, b):",
    "Print the numbers from 0 to 9.",
    "for x in range(10):",
    "Return the sum of a list.",
]
"""Candidate prompts; the first whose greedy answer runs to ``max_tokens`` is used."""
TARGETS = {"overhead_p50_ms": 5.0, "stream_overhead_per_token_ms": 1.0}


def make_checkpoint(root: Path, preset: str) -> tuple[Path, int]:
    from policy.model import build_model, num_parameters, save_checkpoint
    from policy.tokenizer import train_tokenizer

    tok = train_tokenizer(["def add(a, b):\n    return a + b\n", "for x in range(10):\n    print(x)\n"] * 20, 300)
    model = build_model(preset, len(tok), 0)
    return save_checkpoint(model, tok, root / "ckpt"), num_parameters(model)


@dataclass
class Stream:
    """One streamed answer as the client saw it (seconds from sending the request)."""

    ttft: float = 0.0
    done: float = 0.0
    end: float = 0.0
    """The response read to its end (after ``[DONE]``)."""
    chunks: list[float] = field(default_factory=list)
    """Arrival of every chunk with content."""
    text: str = ""
    tokens: int = 0
    finish: str | None = None

    @property
    def gaps_ms(self) -> list[float]:
        return [(b - a) * 1000 for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def stream_once(client: httpx.Client, url: str, body: dict[str, Any]) -> Stream:
    """Send one streamed chat request and time its chunks; reads the response to its end so the
    connection is kept alive."""
    out = Stream()
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - start
            data = line[6:]
            if data.strip() == "[DONE]":
                out.done = now
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: stream error: {chunk['error']}")
            if chunk.get("usage"):
                out.tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if not out.chunks:
                        out.ttft = now
                    out.chunks.append(now)
                    out.text += content
                if choice.get("finish_reason"):
                    out.finish = str(choice["finish_reason"])
        out.end = time.perf_counter() - start
    if not out.done or not out.chunks:
        raise RuntimeError(f"{url}: the stream ended without [DONE] or without content")
    return out


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (linear interpolation between closest ranks)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def compare(base: list[Stream], other: list[Stream]) -> dict[str, float]:
    """Paired statistics of ``other`` against ``base`` (same rounds)."""
    ttft = [(o.ttft - b.ttft) * 1000 for b, o in zip(base, other, strict=True)]
    per_token = [
        ((o.done - b.done) - (o.ttft - b.ttft)) * 1000 / (o.tokens - 1) for b, o in zip(base, other, strict=True)
    ]
    return {
        "overhead_p50_ms": round(statistics.median(ttft), 3),
        "overhead_p90_ms": round(pct(ttft, 90), 3),
        "overhead_ms_p50_difference": round(
            statistics.median(o.ttft for o in other) * 1000 - statistics.median(b.ttft for b in base) * 1000, 3
        ),
        "stream_overhead_per_token_ms": round(statistics.median(per_token), 4),
        "stream_overhead_per_token_ms_p90": round(pct(per_token, 90), 4),
    }


def summary(streams: list[Stream]) -> dict[str, float]:
    ttft = [s.ttft * 1000 for s in streams]
    gaps = [g for s in streams for g in s.gaps_ms]
    return {
        "ttft_ms": round(statistics.median(ttft), 3),
        "ttft_ms_p90": round(pct(ttft, 90), 3),
        "stream_ms": round(statistics.median(s.done * 1000 for s in streams), 2),
        "inter_chunk_ms": round(statistics.median(gaps), 3),
        "end_ms": round(statistics.median((s.end - s.done) * 1000 for s in streams), 3),
    }


def engine_connections(port: int) -> set[int]:
    """Local ports of the TCP connections to ``port`` on loopback (open or in TIME_WAIT)."""
    found = set()
    for conn in psutil.net_connections(kind="tcp4"):
        if conn.raddr and conn.laddr and conn.raddr[1] == port:
            found.add(int(conn.laddr[1]))
    return found


def pick_prompt(client: httpx.Client, url: str, tokens: int, seed: int) -> str:
    """The first candidate prompt whose greedy answer runs to ``tokens`` without stopping."""
    for prompt in PROMPTS:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "seed": seed,
            "stop": [STOP],
        }
        r = client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == tokens:
            return prompt
    raise SystemExit(f"no candidate prompt runs to {tokens} tokens without stopping; change PROMPTS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--preset", default="tiny", help="policy preset of the served model")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of every stream (the stream's length)")
    parser.add_argument("--iterations", type=int, default=30, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=5, help="rounds discarded before measuring")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed of every request")
    parser.add_argument(
        "--no-split", action="store_true", help="skip the third path (the gateway's own body sent to the engine)"
    )
    parser.add_argument("--logs", default=None, help="directory for the engine's log")
    args = parser.parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()[0]

    from serving.config import GatewayConfig
    from serving.gateway import Gateway, create_gateway_app, static_replicas
    from serving.launch import ServerThread, start_engines
    from serving.telemetry import TelemetryEmitter

    paths = ["direct", "gateway"] if args.no_split else ["direct", "gateway", "direct_extras"]
    results: dict[str, list[Stream]] = {p: [] for p in paths}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt, n_params = make_checkpoint(root, args.preset)
        engine = start_engines(ckpt, 1, store=None, log_dir=Path(args.logs) if args.logs else None)[0]
        print(f"engine ready on {engine.url} after {time.perf_counter() - started:.1f} s", file=sys.stderr)
        emitter = TelemetryEmitter(None, root / "spool")
        gw = Gateway(static_replicas([engine.url]), emitter, GatewayConfig(), MODEL_NAME)
        stack = contextlib.ExitStack()
        try:
            srv = stack.enter_context(ServerThread(create_gateway_app(gw)))
            client = stack.enter_context(httpx.Client(timeout=60, trust_env=False))
            prompt = pick_prompt(client, engine.url, args.tokens, args.seed)
            body: dict[str, Any] = {
                "messages": [{"role": "user", "content": prompt}],
                "stream": True,
                "max_tokens": args.tokens,
                "temperature": 0,
                "seed": args.seed,
                "stop": [STOP],
                "stream_options": {"include_usage": True},
            }
            # What the gateway sends the engine for this body (serving.gateway.Gateway.chat / _stream).
            extras = {**body, "n": 1, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}
            target = {"direct": (engine.url, body), "gateway": (srv.url, body), "direct_extras": (engine.url, extras)}
            engine_port = int(engine.url.rsplit(":", 1)[1])
            before = engine_connections(engine_port)
            orders = list(itertools.permutations(paths))
            measure_start = time.perf_counter()
            for i in range(args.warmup + args.iterations):
                order = orders[i % len(orders)]
                got = {p: stream_once(client, *target[p]) for p in order}
                ref = got["direct"]
                for p, s in got.items():
                    if (s.text, s.tokens, s.finish) != (ref.text, args.tokens, "length"):
                        raise SystemExit(
                            f"round {i}: {p} served {s.tokens} tokens ({s.finish}), direct {ref.tokens} "
                            f"({ref.finish}); texts {'equal' if s.text == ref.text else 'differ'}"
                        )
                if i >= args.warmup:
                    for p, s in got.items():
                        results[p].append(s)
            measure_s = time.perf_counter() - measure_start
            opened = len(engine_connections(engine_port) - before)
            print(f"{args.warmup + args.iterations} rounds in {measure_s:.1f} s", file=sys.stderr)
        finally:
            stack.close()  # the gateway's shutdown closes the emitter
            engine.stop()
        telemetry = dict(emitter.stats)

    direct, via = summary(results["direct"]), summary(results["gateway"])
    main_cmp = compare(results["direct"], results["gateway"])
    result: dict[str, Any] = {
        "ttft_ms_direct": direct["ttft_ms"],
        "ttft_ms_gateway": via["ttft_ms"],
        "overhead_p50_ms": main_cmp["overhead_p50_ms"],
        "stream_overhead_per_token_ms": main_cmp["stream_overhead_per_token_ms"],
        "ttft_ms_direct_p90": direct["ttft_ms_p90"],
        "ttft_ms_gateway_p90": via["ttft_ms_p90"],
        "overhead_p90_ms": main_cmp["overhead_p90_ms"],
        "overhead_ms_p50_difference": main_cmp["overhead_ms_p50_difference"],
        "stream_overhead_per_token_ms_p90": main_cmp["stream_overhead_per_token_ms_p90"],
        "stream_ms_direct": direct["stream_ms"],
        "stream_ms_gateway": via["stream_ms"],
        "inter_chunk_ms_direct": direct["inter_chunk_ms"],
        "inter_chunk_ms_gateway": via["inter_chunk_ms"],
        "end_ms_direct": direct["end_ms"],
        "end_ms_gateway": via["end_ms"],
        "meets_targets": main_cmp["overhead_p50_ms"] <= TARGETS["overhead_p50_ms"]
        and main_cmp["stream_overhead_per_token_ms"] <= TARGETS["stream_overhead_per_token_ms"],
        "targets": TARGETS,
    }
    if not args.no_split:
        extras_sum = summary(results["direct_extras"])
        result["split"] = {
            "ttft_ms_direct_extras": extras_sum["ttft_ms"],
            "stream_ms_direct_extras": extras_sum["stream_ms"],
            "inter_chunk_ms_direct_extras": extras_sum["inter_chunk_ms"],
            "engine_extras": compare(results["direct"], results["direct_extras"]),
            "relay": compare(results["direct_extras"], results["gateway"]),
        }
    result.update(
        {
            "tokens_per_stream": args.tokens,
            "iterations": args.iterations,
            "warmup": args.warmup,
            "paths": paths,
            "gateway_streams": args.warmup + args.iterations,
            "engine_connections_opened": opened,
            "telemetry": telemetry,
            "model": f"{args.preset} preset, {n_params} parameters, fp32, 1 CPU engine replica",
            "request": "POST /v1/chat/completions, stream, temperature 0, fixed seed, stop never met",
            "engine_torch_threads": 1,
            "benchmark_torch_threads": torch.get_num_threads(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_avg_before": round(load_before, 2),
            "measure_s": round(measure_s, 1),
            "total_s": round(time.perf_counter() - started, 1),
            "note": "client, gateway (in this process, on a thread) and engine share the machine; "
            "differences are paired within rounds",
        }
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
