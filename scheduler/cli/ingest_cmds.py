"""``undertow ingest``, ``stats``, ``signals``, ``dlq list|replay`` and ``broker``: telemetry in."""

from __future__ import annotations

import typer

dlq_app = typer.Typer(help="Dead letters: list what was rejected and why; replay after a fix.", no_args_is_help=True)


UNREADABLE_EXIT = 3
"""``undertow ingest --once``'s exit status when partitions wait at batches it could not read."""


def ingest(
    once: bool = typer.Option(
        False,
        "--once",
        help="Exit 0 once caught up with the end of every partition. A partition held at a batch that "
        "cannot be read (codec library missing, corrupt) is not retried: the others are caught up, "
        f"then exit {UNREADABLE_EXIT}.",
    ),
    assign: bool = typer.Option(
        False, "--assign", help="Read every partition without joining the consumer group (implied by --once)."
    ),
    max_seconds: float | None = typer.Option(None, help="Stop after this many seconds (default: run until SIGTERM)."),
) -> None:
    """Consume telemetry from Kafka into the database (idempotent; commits after each batch).

    SIGTERM or SIGINT: the batches in hand are committed, then it exits 0. A batch that cannot be read
    (its codec's library missing, or corrupt) holds its partition at that offset, is logged with what to
    do and shown by `undertow stats --json`; it is read again after a back-off (1 s doubling to 30 s by
    default) while the other partitions flow.
    """
    from ingest.consumer import IngestConsumer, UnreadableBatches
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database, require_bootstrap

    settings = setup()
    bootstrap = require_bootstrap(settings)
    engine = open_database(settings)
    consumer = IngestConsumer(
        engine, bootstrap, settings.kafka, settings.ingest, mode="assign" if (once or assign) else "group"
    )
    consumer.install_signal_handlers()
    counts = ("records", "stored", "duplicates", "dead_letters", "batches", "db_retries")
    try:
        stats = consumer.run(once=once, max_seconds=max_seconds)
    except UnreadableBatches as exc:
        if once:
            print_json({key: getattr(consumer.stats, key) for key in counts})
        typer.echo(f"ingest stopped: {exc}", err=True)
        raise typer.Exit(UNREADABLE_EXIT) from exc
    if once:
        print_json({key: getattr(stats, key) for key in counts})


def stats(as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the contract).")) -> None:
    """Counts of stored events by type, sessions, duplicates and dead letters."""
    from ingest.stats import stats as compute
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    data = compute(open_database(settings))
    if as_json:
        print_json(data)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Undertow telemetry")
    table.add_column("what")
    table.add_column("count", justify="right")
    for kind, n in data["events"].items():
        table.add_row(kind, str(n))
    for key in ("sessions", "duplicates", "dead_letters"):
        table.add_row(key, str(data[key]), style="bold")
    Console().print(table)


def signals(
    session_id: list[str] = typer.Option(None, "--session", help="Session id(s); default: every session."),
    limit: int = typer.Option(20, help="Most sessions to print."),
) -> None:
    """Per session every signal with its horizon, and signals still waiting for their session (JSON)."""
    from ingest.joins import orphan_signal_counts, signals_by_session
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    engine = open_database(setup())
    joined = signals_by_session(engine, session_id or None)
    sessions = [
        {
            "session_id": s.session_id,
            "arrived": s.arrived,
            "signals": [
                {"type": v.type, "horizon_s": v.horizon_s, "value": v.value, "occurred_at": v.occurred_at}
                for v in s.signals
            ],
        }
        for s in list(joined.values())[:limit]
    ]
    print_json({"sessions": sessions, "waiting_for_session": orphan_signal_counts(engine)})


@dlq_app.command("list")
def dlq_list(
    reason: str | None = typer.Option(None, help="Only this reason, e.g. invalid_json."),
    pending: bool = typer.Option(False, help="Only dead letters not replayed yet."),
    limit: int = typer.Option(50, help="Most rows, newest first."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List dead letters with their reason, source offset and a preview of the raw bytes."""
    from ingest.dlq import list_dead_letters
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    rows = list_dead_letters(open_database(setup()), reason=reason, pending_only=pending, limit=limit)
    if as_json:
        print_json({"dead_letters": rows})
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"dead letters ({len(rows)})")
    for col in ("id", "reason", "source", "replayed", "preview"):
        table.add_column(col)
    for r in rows:
        source = f"{r['topic']}[{r['partition']}]@{r['offset']}"
        table.add_row(str(r["id"]), r["reason"], source, str(r["replay_count"]), r["preview"][:60])
    Console().print(table)


@dlq_app.command("replay")
def dlq_replay(
    ids: list[int] = typer.Option(None, "--id", help="Dead-letter id(s) to replay."),
    reason: str | None = typer.Option(None, help="Replay every pending dead letter with this reason."),
    all_pending: bool = typer.Option(False, "--all", help="Replay every dead letter not replayed yet."),
) -> None:
    """Re-produce dead letters' raw bytes to the telemetry topic (after fixing what rejected them)."""
    from ingest.dlq import replay
    from ingest.producer import TelemetryProducer
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database, require_bootstrap

    if not (ids or reason or all_pending):
        raise typer.BadParameter("Say what to replay: --id N (repeatable), --reason REASON, or --all.")
    settings = setup()
    engine = open_database(settings)
    max_request = max(2 * settings.kafka.max_message_bytes, 16 << 20)
    with TelemetryProducer(require_bootstrap(settings), settings.kafka.topic, max_request_size=max_request) as producer:
        done = replay(engine, producer, ids=ids or None, reason=reason)
    print_json({"replayed": len(done), "ids": done, "topic": settings.kafka.topic})


def broker(port: int = typer.Option(0, help="Port on 127.0.0.1 (default: a free one).")) -> None:
    """Run the embedded Kafka broker in the foreground (Ctrl-C stops it); other commands find it."""
    import signal
    import threading

    from ingest.embedded import EmbeddedBroker, create_topics
    from scheduler.cli.common import setup

    settings = setup()
    home = settings.home.resolve()
    embedded = EmbeddedBroker(port=port, log_path=home / "broker.log", state_path=home / "broker.json")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with embedded:
        create_topics(
            embedded.bootstrap, {settings.kafka.topic: settings.kafka.partitions, settings.kafka.dlq_topic: 1}
        )
        typer.echo(
            f"Kafka broker on {embedded.bootstrap} (state in {home / 'broker.json'}); Ctrl-C stops it.", err=True
        )
        while not stop.wait(1.0):
            if embedded.process is None or embedded.process.poll() is not None:
                raise SystemExit("The embedded broker exited; see its log in " + str(home / "broker.log"))


def register(app: typer.Typer) -> None:
    """Attach the ingest commands and the ``dlq`` group."""
    app.command("ingest")(ingest)
    app.command("stats")(stats)
    app.command("signals")(signals)
    app.command("broker")(broker)
    app.add_typer(dlq_app, name="dlq")
