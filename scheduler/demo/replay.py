"""Stage 1 of the demo: realistic telemetry replayed through Kafka into the database.

A day of synthetic telemetry (:mod:`ingest.synthetic`; arrivals follow the ServeGen production
trace, late retention signals up to a day later, duplicates, sessions delivered after their
signals, a few malformed messages) is produced with its own timing compressed into the wall-time
budget, while the ingest consumer runs. Progress goes to stderr; the result is plain data.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from scheduler.settings import Settings

log = structlog.get_logger(__name__)

MALFORMED: tuple[bytes, ...] = (
    b'{"schema_version": 1, "event_id": "broken", "type": "session.completed", ',
    b'{"schema_version": 2, "event_id": "from-the-future", "type": "session.completed"}',
    b'{"schema_version": 1, "event_id": "what", "type": "session.teleported", "occurred_at": "2025-01-06T00:00:00Z"}',
)


def run_ingest_stage(
    settings: Settings,
    minutes: float = 1.0,
    requests: int = 600,
    seed: int = 0,
    keep_running: bool = False,
) -> dict[str, Any]:
    """Run stage 1 on the embedded stack and return its numbers (stats as ``undertow stats``)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ingest.joins import orphan_signal_counts
    from ingest.producer import TelemetryProducer
    from ingest.signing import keyring
    from ingest.stats import stats
    from ingest.synthetic import default_trace_path, generate, load_rates
    from scheduler.runtime.embedded import EmbeddedStack

    trace = default_trace_path()
    rates = load_rates(trace) if trace else None
    run_id = uuid.uuid4().hex[:8]
    telemetry = generate(requests, seed=seed, rates=rates, id_prefix=f"demo-{run_id}-")
    items = telemetry.items
    last = max(it.at_s for it in items)
    speedup = last / (minutes * 60.0)
    stored = {"n": 0}
    inject_at = {len(items) * (j + 1) // (len(MALFORMED) + 1): raw for j, raw in enumerate(MALFORMED)}

    def on_commit(report: Any) -> None:
        stored["n"] += report.records

    key = keyring(settings.ingest.signing_keys).get(settings.serving.gateway.signing_key_id)
    started = time.monotonic()
    with EmbeddedStack(settings) as stack:
        stack.start_ingest(on_commit=on_commit)
        total = len(items) + len(MALFORMED)
        with (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            ) as progress,
            TelemetryProducer(stack.bootstrap, settings.kafka.topic, signing_key=key) as producer,
        ):
            sent = progress.add_task(f"produce (trace x{speedup:,.0f})", total=total)
            read = progress.add_task("ingest", total=total)
            for i, item in enumerate(items):
                delay = item.at_s / speedup - (time.monotonic() - started)
                if delay > 0:
                    time.sleep(delay)
                producer.send(item.event)
                if i in inject_at:
                    raw = inject_at[i]  # signed: it must reach validation, which names its reason
                    producer.send_raw(raw, key=b"demo", headers=key.headers(raw) if key else None)
                progress.update(sent, completed=i + 1, refresh=False)
                progress.update(read, completed=stored["n"])
            producer.flush()
            progress.update(sent, completed=total)
            deadline = time.monotonic() + 120
            while stored["n"] < total and time.monotonic() < deadline:
                progress.update(read, completed=stored["n"])
                time.sleep(0.1)
            progress.update(read, completed=stored["n"])
        assert stack.engine is not None
        result = {
            "stage": "ingest",
            "seconds": round(time.monotonic() - started, 2),
            "produced": total,
            "expected_events": telemetry.counts_by_type(),
            "duplicates_sent": sum(1 for it in items if it.duplicate),
            "malformed_sent": len(MALFORMED),
            "stats": stats(stack.engine),
            "waiting_for_session": orphan_signal_counts(stack.engine),
            "bootstrap": stack.bootstrap,
            "database": settings.resolved()["database_url"],
            "trace": trace.name if trace else None,
        }
        if keep_running:
            _wait_for_interrupt(stack.bootstrap)
    return result


def _wait_for_interrupt(bootstrap: str) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("demo.running", bootstrap=bootstrap, hint="`undertow stats --json` in another shell; Ctrl-C stops")
    stop.wait()
