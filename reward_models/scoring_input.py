"""Read ``session.completed`` envelopes for scoring (JSONL, one envelope per line), validated against the contract.

Every line is checked with the same parser the ingest consumer uses
(:func:`ingest.schemas.parse_event`: size limit, strict types, logprobs length); a bad line
stops with its line number and the machine-readable reason, so no reward is printed for input
that is not what the contract says. Blank lines are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ingest import schemas


def read_envelopes(lines: Iterable[str | bytes], max_bytes: int = schemas.DEFAULT_MAX_BYTES) -> list[dict[str, Any]]:
    """Validated envelopes as plain dicts, in input order; ``ValueError`` naming the first bad line."""
    out: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        raw = line.encode("utf-8") if isinstance(line, str) else line
        if not raw.strip():
            continue
        try:
            event = schemas.parse_event(raw.strip(), max_bytes=max_bytes)
        except schemas.InvalidEvent as exc:
            raise ValueError(f"line {number}: {exc.reason}: {exc.detail[:300]}") from None
        if event.type != schemas.SESSION_COMPLETED:
            raise ValueError(
                f"line {number}: type {event.type!r} cannot be scored; only session.completed envelopes can"
            )
        out.append(event.model_dump(mode="json"))
    return out
