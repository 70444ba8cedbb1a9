"""``undertow engine serve``, ``undertow gateway``, ``undertow fleet ...`` and ``undertow deploy ...``."""

from __future__ import annotations

from typing import Annotated

import typer

engine_app = typer.Typer(help="The CPU reference engine (vLLM's OpenAI-server subset).", no_args_is_help=True)
fleet_app = typer.Typer(help="The fleet registry: replicas, their state, version and health.", no_args_is_help=True)
deploy_app = typer.Typer(
    help="Roll a weights version out to the fleet: canary, gate, progressive, rollback.", no_args_is_help=True
)


@engine_app.command("serve")
def engine_serve(
    checkpoint: Annotated[str, typer.Option(help="Hugging Face checkpoint directory to load.")],
    version: Annotated[str, typer.Option(help="Weights version the checkpoint holds.")] = "v0",
    store: Annotated[str | None, typer.Option(help="Weight store to pull updates from (path or fsspec URL).")] = None,
    host: Annotated[str | None, typer.Option(help="Interface to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    routed_experts: Annotated[bool | None, typer.Option(help="Return routed experts with each choice.")] = None,
) -> None:
    """Serve the engine contract over HTTP with the torch policy (control routes need
    serving.fleet.control_token; pulled versions must be signed by a key in policy.weights.public_key)."""
    from scheduler.cli.common import setup
    from serving.engine import serve

    settings = setup()
    cfg = settings.serving.engine.model_copy()
    if host is not None:
        cfg.host = host
    if port is not None:
        cfg.port = port
    if routed_experts is not None:
        cfg.enable_return_routed_experts = routed_experts
    public_key = settings.home / settings.policy.weights.public_key
    serve(checkpoint, version, store, cfg, public_key=public_key, control_token=settings.serving.fleet.control_token)


@fleet_app.command("register")
def fleet_register(
    replica_id: Annotated[str, typer.Argument(help="Replica name.")],
    url: Annotated[str, typer.Argument(help="Engine base URL, e.g. http://127.0.0.1:8200.")],
    pool: Annotated[str, typer.Option(help="Pool the replica serves.")] = "default",
    region: Annotated[str, typer.Option(help="Region of the replica.")] = "local",
    backend: Annotated[str, typer.Option(help="cpu or vllm.")] = "cpu",
) -> None:
    """Add a replica to the registry (it joins rotation after a healthy check)."""
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.fleet import register_replica

    rep = register_replica(open_database(setup()), replica_id, url, pool=pool, region=region, backend=backend)
    print_json(rep.__dict__)


@fleet_app.command("target")
def fleet_target(
    version: Annotated[str, typer.Argument(help="Version the pool should serve.")],
    weights_hash: Annotated[str, typer.Argument(help="Its weights hash.")],
    pool: Annotated[str, typer.Option(help="Pool.")] = "default",
) -> None:
    """Set the version a pool should serve (bootstrap; deployments move it afterwards)."""
    from scheduler.cli.common import setup
    from scheduler.runtime import open_database
    from serving.fleet import set_target

    set_target(open_database(setup()), version, weights_hash, pool)


@fleet_app.command("check")
def fleet_check(
    pool: Annotated[str | None, typer.Option(help="Only this pool.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Health-check every replica once and print the registry."""
    import asyncio

    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.fleet import check_fleet

    settings = setup()
    reps = asyncio.run(
        check_fleet(
            open_database(settings), settings.serving.fleet, pool, stale_after_s=settings.serving.deploy.stale_after_s
        )
    )
    rows = [r.__dict__ | {"in_rotation": r.in_rotation} for r in reps]
    if json_out:
        print_json({"replicas": rows})
    else:
        for r in rows:
            typer.echo(f"{r['id']:12} {r['state']:9} {r['health']:13} {r['version'] or '-':12} {r['url']}")


@fleet_app.command("reconcile")
def fleet_reconcile(pool: Annotated[str, typer.Option(help="Pool.")] = "default") -> None:
    """Bring behind or mismatching replicas to the pool's target by the cheapest path."""
    import asyncio

    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.fleet import check_fleet, reconcile

    settings = setup()
    db = open_database(settings)
    asyncio.run(check_fleet(db, settings.serving.fleet, pool, stale_after_s=settings.serving.deploy.stale_after_s))
    print_json({"outcomes": asyncio.run(reconcile(db, settings.serving.fleet, pool))})


@deploy_app.command("rollout")
def deploy_rollout(
    version: Annotated[str, typer.Argument(help="Version to roll out.")],
    weights_hash: Annotated[str, typer.Argument(help="Its weights hash (verified on every replica).")],
    pool: Annotated[str, typer.Option(help="Pool.")] = "default",
    snapshot: Annotated[bool, typer.Option(help="Pull full snapshots instead of deltas.")] = False,
    gateway: Annotated[str | None, typer.Option(help="Gateway URL whose /gateway/metrics gate each stage.")] = None,
    gateway_key: Annotated[
        str | None,
        typer.Option(
            help="Key with the metrics scope (default: serving.gateway.metrics_key).", envvar="UNDERTOW_GATEWAY_KEY"
        ),
    ] = None,
) -> None:
    """Canary, gate, progressive stages; rolls back by itself when a gate fails."""
    import asyncio
    import dataclasses

    import httpx

    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.deploy import rollout

    settings = setup()
    metrics = None
    if gateway:
        setting = settings.serving.gateway.metrics_key
        key = gateway_key or (setting.get_secret_value() if setting else None)
        headers = {"authorization": f"Bearer {key}"} if key else {}

        async def metrics() -> dict:  # type: ignore[type-arg]
            async with httpx.AsyncClient(timeout=10, headers=headers) as c:
                response = await c.get(gateway.rstrip("/") + "/gateway/metrics")
                response.raise_for_status()
                return response.json()  # type: ignore[no-any-return]

    result = asyncio.run(
        rollout(
            open_database(settings),
            version,
            weights_hash,
            settings.serving.deploy,
            pool=pool,
            kind="snapshot" if snapshot else "auto",
            metrics=metrics,
            fleet_config=settings.serving.fleet,
        )
    )
    print_json(dataclasses.asdict(result))
    if result.status != "succeeded":
        raise typer.Exit(1)


@deploy_app.command("list")
def deploy_list(limit: Annotated[int, typer.Option(help="Most recent deployments to show.")] = 20) -> None:
    """Recent deployments with their stages and outcomes."""
    from sqlalchemy import select

    from ingest.db import transaction
    from scheduler.cli.common import print_json, setup
    from scheduler.runtime import open_database
    from serving.tables import DeploymentRow

    with transaction(open_database(setup())) as s:
        rows = s.scalars(select(DeploymentRow).order_by(DeploymentRow.id.desc()).limit(limit)).all()
        out = [
            {
                "id": r.id,
                "pool": r.pool,
                "from": r.from_version,
                "to": r.to_version,
                "kind": r.kind,
                "status": r.status,
                "message": r.message,
                "stages": [{"name": st.name, "replicas": st.replicas, "outcome": st.outcome} for st in r.stages],
            }
            for r in rows
        ]
    print_json({"deployments": out})


def gateway_cmd(
    replica: Annotated[
        list[str] | None, typer.Option(help="Static replica URL (repeat); default: the registry.")
    ] = None,
    pool: Annotated[str, typer.Option(help="Registry pool to balance over.")] = "default",
    host: Annotated[str | None, typer.Option(help="Interface to listen on (default: serving.gateway.host).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: serving.gateway_port).")] = None,
    telemetry: Annotated[bool, typer.Option(help="Emit session.completed and signals to Kafka.")] = True,
) -> None:
    """The user-facing OpenAI-compatible gateway with telemetry and signal endpoints."""
    from scheduler.cli.common import setup
    from scheduler.runtime import open_database
    from scheduler.runtime.gateway import gateway_emitter, gateway_keys
    from serving.gateway import Gateway, health_loop, registry_source, serve_gateway, static_replicas

    settings = setup()
    cfg = settings.serving.gateway
    background = []
    db = open_database(settings) if cfg.require_keys or not replica else None
    if replica:
        source = static_replicas(replica)
    else:
        assert db is not None
        source = registry_source(db, pool, cfg.fleet_refresh_s)
        background.append(health_loop(db, settings.serving.fleet, pool))
    emitter = gateway_emitter(settings) if telemetry else None
    keys = gateway_keys(settings, db) if cfg.require_keys else None
    gateway = Gateway(source, emitter, cfg, settings.serving.engine.served_model_name, keys)
    serve_gateway(gateway, host or cfg.host, port or settings.serving.gateway_port, background)


def register(app: typer.Typer) -> None:
    """Attach the serving commands."""
    app.add_typer(engine_app, name="engine")
    app.add_typer(fleet_app, name="fleet")
    app.add_typer(deploy_app, name="deploy")
    app.command("gateway")(gateway_cmd)
