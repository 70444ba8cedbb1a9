"""``undertow import realhumaneval PATH`` and ``undertow import table PATH --map ...``: files sent through
Kafka as wire-contract telemetry.

The rows become envelopes (:mod:`ingest.realhumaneval` for that public data set, :mod:`ingest.table_import`
for any CSV, TSV or JSON Lines table by a column mapping), are sent with the producer SDK (validated,
keyed by ``session_id``, ``acks=all``) to ``kafka.topic``, and reach the database through ``undertow
ingest`` like production telemetry. Event ids are fixed by the rows, so importing again stores nothing
twice (ingest counts the second copies as duplicates).

When ingest verifies signatures (``ingest.signing_keys``), the import is signed like an operator's
dead-letter replay: with the key ``ingest.replay_signing_key_id`` names, or the one ``--key-id`` names.
An import whose key is not configured is refused before anything is sent, since ingest would
dead-letter every event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from ingest.config import IngestConfig
    from ingest.imports import ImportResult
    from ingest.signing import SigningKey
    from scheduler.settings import Settings

import_app = typer.Typer(
    help="Import public data sets as telemetry, through Kafka like production events.", no_args_is_help=True
)

SHOWN_SKIPS = 20
"""Skipped rows listed by the human-readable summary (``--json`` lists them all)."""


@import_app.command("realhumaneval")
def realhumaneval(
    path: Path = typer.Argument(..., help="RealHumanEval's chat_data.csv."),
    limit: int | None = typer.Option(None, "--limit", min=0, help="Read at most N rows."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Read and validate every row; send nothing."),
    study_start: str | None = typer.Option(
        None,
        "--study-start",
        help="When every programmer's session starts (ISO 8601 with an offset); default: 00:00 UTC yesterday, "
        "recent enough for ingest.retention_days and in the past, so reward training windows hold it.",
    ),
    key_id: str | None = typer.Option(
        None, "--key-id", help="Sign with this key of ingest.signing_keys (default: ingest.replay_signing_key_id)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Send RealHumanEval's chat answers as telemetry: per row a session.completed and an edit signal.

    A copied answer is an edit.accepted, one without a copy an edit.rejected (ingest.realhumaneval says
    why). Malformed rows are skipped and listed with their row, line and reason; the rest are sent.
    """
    from ingest.imports import yesterday
    from ingest.realhumaneval import read_events
    from scheduler.cli.common import setup

    settings = setup()
    start = _study_start(study_start, "--study-start") if study_start else yesterday()
    with _readable(path):
        result = read_events(path, limit=limit, study_start=start, max_bytes=settings.kafka.max_message_bytes)
    _deliver(
        settings,
        result,
        {"source": "realhumaneval", "path": str(path), "study_start": start.isoformat()},
        dry_run,
        key_id,
        as_json,
    )


@import_app.command("table")
def table(
    path: Path = typer.Argument(..., help="A CSV, TSV or JSON Lines file, one answer per row."),
    mapping: list[str] = typer.Option(
        ...,
        "--map",
        help="role=column, repeated or comma-separated. Required: user, response. Optional: prompt, label, time, "
        "conversation, model, task, logprob, id (ingest.table_import says what each means).",
    ),
    fmt: str | None = typer.Option(None, "--format", help="csv, tsv or jsonl (default: from the suffix)."),
    time_format: str = typer.Option(
        "iso", "--time-format", help="How the time column reads: iso, unix, unix_ms or offset (seconds after --start)."
    ),
    start: str | None = typer.Option(
        None,
        "--start",
        help="ISO 8601 with an offset: what offset times count from, and row n's time (plus n seconds) when no "
        "column holds one; default: 00:00 UTC yesterday.",
    ),
    source: str = typer.Option("table", "--source", help="The sessions' payload source (a name for the data set)."),
    limit: int | None = typer.Option(None, "--limit", min=0, help="Read at most N rows."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Read and validate every row; send nothing."),
    key_id: str | None = typer.Option(
        None, "--key-id", help="Sign with this key of ingest.signing_keys (default: ingest.replay_signing_key_id)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Send any table of answers and adoption labels as telemetry: per row a session.completed, and an
    edit.accepted or edit.rejected where its label says.

    Example: undertow import table suggestions.jsonl --map user=uid,prompt=prefix,response=text,label=accepted
    Malformed rows are skipped and listed with their row, line and reason; the rest are sent.
    """
    from ingest.imports import yesterday
    from ingest.table_import import ColumnMap, read_events
    from scheduler.cli.common import setup

    try:
        columns = ColumnMap.parse(mapping)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--map") from None
    settings = setup()
    begin = _study_start(start, "--start") if start else yesterday()
    with _readable(path):
        result = read_events(
            path,
            columns,
            fmt=fmt,
            time_format=time_format,
            start=begin,
            limit=limit,
            source=source,
            max_bytes=settings.kafka.max_message_bytes,
        )
    info = {"source": source, "path": str(path), "columns": columns.columns, "start": begin.isoformat()}
    _deliver(settings, result, info, dry_run, key_id, as_json)


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """A file the importer cannot read, or arguments it refuses, exit 2 with the reason."""
    from ingest.imports import FormatError

    try:
        yield
    except FormatError as exc:
        raise typer.BadParameter(str(exc), param_hint="PATH") from None
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint="PATH") from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _deliver(
    settings: Settings, result: ImportResult, info: dict[str, Any], dry_run: bool, key_id: str | None, as_json: bool
) -> None:
    """Warn about times, send (unless a dry run) and print the summary."""
    from scheduler.cli.common import print_json

    summary: dict[str, Any] = {**info, **result.summary()}
    warnings = _time_warnings(result.events, settings.ingest.retention_days)
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    summary.update(dry_run=dry_run, sent=0, topic=settings.kafka.topic, signed_with=None, warnings=warnings)
    if not dry_run and result.events:
        key = _signing_key(settings.ingest, key_id)
        summary["signed_with"] = key.key_id if key else None
        summary["sent"] = _send(settings, result.events, key)
    if as_json:
        print_json(summary)
    else:
        _print_summary(summary)


def _study_start(text: str, option: str) -> datetime:
    try:
        start = datetime.fromisoformat(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not an ISO 8601 time", param_hint=option) from None
    if start.tzinfo is None:
        raise typer.BadParameter(f"{text!r} has no offset; add one, e.g. 2024-06-01T00:00:00+00:00", param_hint=option)
    return start


def _time_warnings(events: list[dict[str, Any]], retention_days: int) -> list[str]:
    """Sessions the retention job would delete at once, or that lie in the future (no training window has them)."""
    times = [datetime.fromisoformat(e["occurred_at"]) for e in events if e["type"] == "session.completed"]
    if not times:
        return []
    now = datetime.now(UTC)
    out = []
    if retention_days > 0:
        expired = sum(t < now - timedelta(days=retention_days) for t in times)
        if expired:
            out.append(
                f"{expired} of {len(times)} sessions occurred more than ingest.retention_days ({retention_days}) "
                "ago: the retention job deletes them on its next run; pass a recent --study-start "
                "or set ingest.retention_days=0"
            )
    future = sum(t > now for t in times)
    if future:
        out.append(f"{future} of {len(times)} sessions lie in the future: reward training windows end now")
    return out


def _signing_key(cfg: IngestConfig, key_id: str | None) -> SigningKey | None:
    """The key to sign with (None: ingest checks no signatures); exits 2 when the key named is not configured."""
    from ingest.signing import keyring

    if not cfg.signing_keys and key_id is None:
        return None
    name = key_id or cfg.replay_signing_key_id
    key = keyring(cfg.signing_keys).get(name)
    if key is None:
        if cfg.signing_keys:
            configured = ", ".join(sorted(cfg.signing_keys))
            why = f"not one of ingest.signing_keys ({configured}); ingest would dead-letter every event"
        else:
            why = (
                "not configured: ingest.signing_keys is empty (ingest checks no signatures, so --key-id is not needed)"
            )
        typer.echo(
            f"error: signing key {name!r} is {why}. Make it with `undertow telemetry-keys new {name}` and add it to "
            "ingest.signing_keys, or pass --key-id with a configured key. Nothing was sent.",
            err=True,
        )
        raise typer.Exit(2)
    return key


def _send(settings: Settings, events: list[dict[str, Any]], key: SigningKey | None) -> int:
    """Send ``events`` in order, with a progress bar of acknowledgements; returns how many the broker took."""
    from kafka.errors import KafkaError
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ingest.embedded import create_topics
    from ingest.producer import TelemetryProducer
    from scheduler.runtime import require_bootstrap

    bootstrap = require_bootstrap(settings)
    kafka = settings.kafka
    max_request = max(2 * kafka.max_message_bytes, 16 << 20)
    acked = 0
    try:
        if settings.ingest.create_topics:
            create_topics(bootstrap, {kafka.topic: kafka.partitions, kafka.dlq_topic: 1})
        with (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            ) as progress,
            TelemetryProducer(bootstrap, kafka.topic, signing_key=key, max_request_size=max_request) as producer,
        ):
            bar = progress.add_task(f"send to {kafka.topic}", total=len(events))
            futures = []
            for event in events:
                future = producer.send(event)
                future.add_callback(lambda _meta: progress.advance(bar))
                futures.append(future)
            producer.flush()
            for future in futures:
                future.get(timeout=60)
                acked += 1
    except KafkaError as exc:
        typer.echo(
            f"error: the broker at {bootstrap} did not take every event ({exc}); "
            f"{acked} of {len(events)} acknowledged. Run the import again: ingest stores each event once.",
            err=True,
        )
        raise typer.Exit(1) from None
    return acked


def _print_summary(summary: dict[str, Any]) -> None:
    verb = (
        "read (dry run, nothing sent)" if summary["dry_run"] else f"sent {summary['sent']} events to {summary['topic']}"
    )
    typer.echo(
        f"{summary['path']}: {summary['rows']} rows, {verb}: {summary['sessions']} sessions "
        f"({summary['conversations']} conversations, {summary['users']} users), {summary['signals']} signals "
        f"({summary['accepted']} accepted, {summary['rejected']} rejected); {summary['skipped']} rows skipped"
        + (f"; signed with {summary['signed_with']}" if summary["signed_with"] else "")
    )
    for skip in summary["skipped_rows"][:SHOWN_SKIPS]:
        typer.echo(f"  row {skip['row']} (line {skip['line']}): {skip['reason']}")
    if summary["skipped"] > SHOWN_SKIPS:
        typer.echo(f"  ... and {summary['skipped'] - SHOWN_SKIPS} more (--json lists them all)")


def register(app: typer.Typer) -> None:
    """Attach the ``import`` group."""
    app.add_typer(import_app, name="import")
