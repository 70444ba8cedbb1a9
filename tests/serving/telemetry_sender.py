"""A telemetry sender process for the crash tests: the gateway's emitter on a spool directory, emitting
``--events`` signals (event ids ``{prefix}-{i}``, padded to about ``--bytes`` each) and then running
until killed, printing its counters as one JSON line every 0.1 s.

Run from the repository root: ``python tests/serving/telemetry_sender.py --bootstrap HOST:PORT ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--spool", required=True)
    parser.add_argument("--events", type=int, default=0)
    parser.add_argument("--prefix", default="ev")
    parser.add_argument("--bytes", type=int, default=2000)
    args = parser.parse_args()

    from ingest.producer import TelemetryProducer
    from serving.telemetry import PRODUCER_OPTIONS, TelemetryEmitter

    emitter = TelemetryEmitter(
        lambda: TelemetryProducer(args.bootstrap, args.topic, **PRODUCER_OPTIONS),
        args.spool,
        retry_interval_s=0.3,
        send_timeout_s=3.0,
    )
    pad = "x" * args.bytes
    for i in range(args.events):
        event = {
            "schema_version": 1,
            "event_id": f"{args.prefix}-{i}",
            "type": "feedback.thumbs",
            "occurred_at": "2026-01-01T00:00:00+00:00",
            "session_id": f"s-{i % 97}",
            "payload": {"value": 1, "note": pad},
        }
        if not emitter.emit(event):
            raise SystemExit(f"event {i} was not kept: {emitter.snapshot()}")
    while True:
        print(json.dumps(emitter.snapshot()), flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
