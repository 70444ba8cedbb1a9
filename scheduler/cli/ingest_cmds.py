"""``undertow ingest [sweep]``, ``stats``, ``signals``, ``dlq``, ``telemetry-keys`` and ``broker``: telemetry in."""

from __future__ import annotations

import typer

dlq_app = typer.Typer(help="Dead letters: list what was rejected and why; replay after a fix.", no_args_is_help=True)
ingest_app = typer.Typer(invoke_without_command=True)  # its help: the docstring of ``ingest``
keys_app = typer.Typer(help="Keys producers sign telemetry with (ingest.signing_keys).", no_args_is_help=True)


UNREADABLE_EXIT = 3
"""``undertow ingest --once``'s exit status when partitions wait at batches it could not read."""


def ingest(
    ctx: typer.Context,
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
    """Consume telemetry from Kafka into the database (idempotent; commits after each batch), or `sweep`.

    SIGTERM or SIGINT: the batches in hand are committed, then it exits 0. A batch that cannot be read
    (its codec's library missing, or corrupt) holds its partition at that offset, is logged with what to
    do and shown by `undertow stats --json`; it is read again after a back-off (1 s doubling to 30 s by
    default) while the other partitions flow. Every `ingest.unmatched_sweep_interval_s` it moves signals whose
    session did not arrive within `ingest.unmatched_signal_ttl_s` to the dead letters (unknown_session).
    """
    if ctx.invoked_subcommand is not None:
        return
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


@ingest_app.command("sweep")
def ingest_sweep(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Move signals whose session never arrived to the dead letters (reason unknown_session); print what moved.

    A signal is moved once its session has not arrived `ingest.unmatched_signal_ttl_s` seconds after the signal
    was received, in one transaction per chunk. The running consumer does the same every
    `ingest.unmatched_sweep_interval_s`; this examines every signal.
    """
    from ingest.unmatched import sweep_unmatched
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database

    settings = setup()
    result = sweep_unmatched(open_database(settings), settings.ingest.unmatched_signal_ttl_s, settings.kafka.topic)
    published = 0
    bootstrap = settings.resolved_kafka_bootstrap()
    if result.letters and bootstrap:  # the dead-letter topic mirrors the table (best effort, as the consumer)
        from kafka.errors import KafkaError

        from ingest.dlq import publish

        try:
            published = publish(bootstrap, settings.kafka.dlq_topic, result.letters)
        except KafkaError as exc:  # the table holds them: that is the store
            typer.echo(f"warning: the dead-letter topic was not written ({exc}); the table holds them", err=True)
    data = {**result.as_dict(), "ttl_s": settings.ingest.unmatched_signal_ttl_s, "published": published}
    if as_json:
        print_json(data)
        return
    typer.echo(f"moved {data['moved']} signal(s) to the dead letters (unknown_session); examined {data['examined']}")
    for moved in data["signals"]:
        typer.echo(f"  {moved['event_id']} {moved['type']} session {moved['session_id']} waited {moved['waited_s']} s")


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
    for key in ("sessions", "duplicates", "dead_letters", "unknown_session_dead_letters"):
        if key in data:
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
    """Re-produce dead letters' raw bytes to the telemetry topic (after fixing what rejected them).

    When ingest verifies signatures, replays are signed with the key ``ingest.replay_signing_key_id`` names (an
    operator's replay is trusted); without that key they go unsigned, and the output says so.
    """
    from ingest.dlq import replay, replay_key
    from ingest.producer import TelemetryProducer
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database, require_bootstrap

    if not (ids or reason or all_pending):
        raise typer.BadParameter("Say what to replay: --id N (repeatable), --reason REASON, or --all.")
    settings = setup()
    engine = open_database(settings)
    max_request = max(2 * settings.kafka.max_message_bytes, 16 << 20)
    key, unsigned_because = replay_key(settings.ingest)
    if unsigned_because:
        typer.echo(f"warning: {unsigned_because}", err=True)
    with TelemetryProducer(require_bootstrap(settings), settings.kafka.topic, max_request_size=max_request) as producer:
        done = replay(engine, producer, ids=ids or None, reason=reason, signing_key=key)
    out = {"replayed": len(done), "ids": done, "topic": settings.kafka.topic, "signed_with": key and key.key_id}
    if unsigned_because:
        out["warning"] = unsigned_because
    print_json(out)


@keys_app.command("new")
def keys_new(
    name: str = typer.Argument(..., help="The key id (1 to 64 ASCII characters), e.g. the producer's name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Make a producer key: a fresh secret for NAME, and how to add it to ingest's keys.

    Nothing is stored: add the key to ``ingest.signing_keys`` (environment or undertow.toml) where ingest and the
    gateway run, and give the producer NAME and the secret (it signs with ``ingest.signing.SigningKey``).
    """
    import json
    import shlex

    from ingest.signing import SigningKey, new_secret

    secret = new_secret()
    try:
        SigningKey(name, secret.encode())
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    data = {
        "key_id": name,
        "secret": secret,
        "env": "UNDERTOW_INGEST__SIGNING_KEYS=" + shlex.quote(json.dumps({name: secret})),
        "toml": f"[ingest.signing_keys]\n{json.dumps(name)} = {json.dumps(secret)}",
        "note": "UNDERTOW_INGEST__SIGNING_KEYS holds every key as one JSON object: merge this one into the keys "
        "already configured (in undertow.toml, add the line to the [ingest.signing_keys] table). Once any key is "
        "configured, unsigned records are dead letters: configure the gateway's key and "
        "ingest.replay_signing_key_id's key too.",
    }
    if as_json:
        from scheduler.cli.common import print_json

        print_json(data)
        return
    for field in ("key_id", "secret", "env", "toml", "note"):
        typer.echo(f"{field}: {data[field]}")


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
    """Attach the ingest commands and the ``ingest``, ``dlq`` and ``telemetry-keys`` groups."""
    ingest_app.callback()(ingest)
    app.add_typer(ingest_app, name="ingest")
    app.command("stats")(stats)
    app.command("signals")(signals)
    app.command("broker")(broker)
    app.add_typer(dlq_app, name="dlq")
    app.add_typer(keys_app, name="telemetry-keys")
