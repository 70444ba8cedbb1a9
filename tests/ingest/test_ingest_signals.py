"""SIGTERM and SIGINT stop ``undertow ingest`` within 10 s while events stream in, committing what it stored.

Run as an operator runs it (the consumer group's ``undertow ingest`` against the embedded broker),
stopped mid-stream once by SIGTERM and once by SIGINT (Ctrl-C); afterwards ``--once`` reads the
rest. Every event ends up stored exactly once: nothing lost, no duplicate recorded, so every batch
a stopped consumer had read was either committed with its offsets or not at all.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ingest_helpers import (
    assert_exactly_once,
    cli_env,
    last_json,
    produce_in_background,
    reap,
    start_ingest,
    stored_count,
    stream_events,
    undertow,
    wait_for,
)
from sqlalchemy import func, select

from ingest.config import KafkaConfig
from ingest.db import make_engine, transaction, upgrade
from ingest.embedded import create_topics
from ingest.tables import ConsumerOffsetRow

STOP_WITHIN_S = 10.0


def stop_mid_stream(
    proc: subprocess.Popen[bytes], log_path: Path, engine: Any, sig: signal.Signals, stream: Any
) -> float:
    """Once the consumer stores events, send ``sig`` while ``stream`` still produces; the seconds it took
    to exit (status 0)."""
    wait_for(lambda: "ingest.assigned" in log_path.read_text(errors="replace"), 60, "the consumer's assignment")
    before = stored_count(engine)
    wait_for(lambda: stored_count(engine) > before + 200, 60, "events stored by this consumer")
    assert stream.is_alive(), "the stream ended before the stop: it would not land mid-stream"
    sent = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=STOP_WITHIN_S + 20)
    took = time.monotonic() - sent
    assert code == 0, log_path.read_text(errors="replace")[-2000:]
    assert "ingest.stopped" in log_path.read_text(errors="replace")
    return took


def test_sigterm_and_sigint_stop_ingest_mid_stream_within_10_s_without_loss_or_duplicates(
    tmp_path: Path, broker: Any, kafka_cfg: KafkaConfig
) -> None:
    create_topics(broker.bootstrap, {kafka_cfg.topic: kafka_cfg.partitions, kafka_cfg.dlq_topic: 1})
    url = f"sqlite:///{tmp_path / 'signals.db'}"
    upgrade(url)
    engine = make_engine(url)
    env = dict(cli_env(tmp_path, broker.bootstrap, kafka_cfg), UNDERTOW_DATABASE_URL=url)
    events = stream_events(12_500, seed=31)  # 25,000 events at 1,000/s: both stops land mid-stream
    producer = produce_in_background(broker.bootstrap, kafka_cfg.topic, events, rate=1000)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            log_path = tmp_path / f"ingest-{sig.name}.log"
            procs.append(start_ingest(env, log_path))
            took = stop_mid_stream(procs[-1], log_path, engine, sig, producer)
            assert took < STOP_WITHIN_S, f"{sig.name}: exited after {took:.1f} s"
            with transaction(engine) as s:  # what the stopped consumer stored, it committed with its offsets
                committed = s.scalar(select(func.sum(ConsumerOffsetRow.next_offset))) or 0
            assert stored_count(engine) == committed
        producer.join(timeout=90)
        assert not producer.is_alive()
        rest = undertow(["ingest", "--once"], env, timeout=180)
        assert rest.returncode == 0, rest.stderr[-2000:]
        assert last_json(rest.stdout)["duplicates"] == 0
    finally:
        reap(procs)
    assert_exactly_once(engine, events)
    engine.dispose()
