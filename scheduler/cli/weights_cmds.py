"""``undertow weights``: list, diff, verify, put, garbage-collect and serve the versioned weight store,
and the key that signs its versions (``keygen``, ``sign``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from policy.weights import Keyring, WeightStore
    from scheduler.settings import Settings

weights_app = typer.Typer(help="Versioned policy weights: snapshots and bit-exact deltas.", no_args_is_help=True)


def open_store(settings: Settings) -> WeightStore:
    """The weight store the settings point at (a relative path lives under the Undertow home)."""
    from policy.weights import open_store

    return open_store(settings.policy, settings.home)


def keyring(settings: Settings) -> Keyring:
    """The public keys versions are verified with (``policy.weights.public_key`` under the home)."""
    from policy.weights import Keyring

    return Keyring.from_config(settings.policy.weights, settings.home)


def _in_use(settings: Settings) -> set[str]:
    """Versions the fleet's replicas hold or move to (the garbage collector keeps them)."""
    from ingest.db import make_engine
    from serving.fleet import versions_in_use

    engine = make_engine(settings.resolved_database_url)
    try:
        return versions_in_use(engine)
    finally:
        engine.dispose()


@weights_app.command("list")
def list_versions(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List complete versions with their artifacts and sizes."""
    from scheduler.cli.common import print_json, setup

    store = open_store(setup())
    rows: list[dict[str, Any]] = [
        {
            "version": m.version,
            "parent": m.parent,
            "created_at": m.created_at,
            "tensors": len(m.tensors),
            "raw_bytes": m.total_bytes(),
            "full_bytes": m.full.bytes if m.full else None,
            "delta_bytes": m.delta.bytes if m.delta else None,
            "version_hash": m.version_hash,
            "signed_by": m.signature.key_id if m.signature else None,
        }
        for m in store.manifests()
    ]
    if as_json:
        print_json({"store": store.url, "versions": rows})
        return
    for row in rows:
        typer.echo(
            f"{row['version']}  parent={row['parent'] or '-'}  full={row['full_bytes'] or '-'}  "
            f"delta={row['delta_bytes'] or '-'}  hash={row['version_hash'][:16]}"
        )


@weights_app.command("diff")
def diff(
    a: str = typer.Argument(..., help="Base version."),
    b: str = typer.Argument(..., help="Target version."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Per tensor: how many elements changed between A and B and the encoded delta size."""
    import numpy as np

    from policy.weights.codec import encode_tensor
    from policy.weights.format import magnitude_mask
    from scheduler.cli.common import print_json, setup

    store = open_store(setup())
    ma, mb = store.manifest(a), store.manifest(b)
    chain_a, chain_b = store.chain(a), store.chain(b)
    rows: list[dict[str, Any]] = []
    for name, meta in mb.tensors.items():
        old = ma.tensors.get(name)
        target = store.words(b, name, chain_b)
        base = store.words(a, name, chain_a) if old and old.dtype == meta.dtype and old.shape == meta.shape else None
        changed = int(np.count_nonzero(base ^ target)) if base is not None else target.size
        mask = magnitude_mask(meta.dtype) if store.config.magnitude_classes else None
        encoded = encode_tensor(base, target, mask, level=store.config.zstd_level)
        rows.append(
            {
                "tensor": name,
                "changed": changed,
                "numel": target.size,
                "encoding": encoded.encoding,
                "delta_bytes": len(encoded.payload),
                "raw_bytes": target.nbytes,
            }
        )
    removed = [n for n in ma.tensors if n not in mb.tensors]
    summary = {
        "a": a,
        "b": b,
        "changed": sum(r["changed"] for r in rows),
        "numel": sum(r["numel"] for r in rows),
        "delta_bytes": sum(r["delta_bytes"] for r in rows),
        "raw_bytes": sum(r["raw_bytes"] for r in rows),
        "removed": removed,
    }
    if as_json:
        print_json({**summary, "tensors": rows})
        return
    for r in rows:
        if r["changed"]:
            typer.echo(f"{r['tensor']}: {r['changed']}/{r['numel']} changed, {r['encoding']} {r['delta_bytes']} B")
    typer.echo(
        f"total: {summary['changed']}/{summary['numel']} changed, delta {summary['delta_bytes']} B "
        f"of {summary['raw_bytes']} B; removed {removed or 'none'}"
    )


@weights_app.command("verify")
def verify(
    version: str = typer.Argument(..., help="Version to verify (every artifact, every tensor)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Check a version as a replica would (its signature against policy.weights.public_key, then every
    artifact rebuilt and every checksum and digest checked); exit 1 on any failure."""
    from policy.weights import WeightsError, WeightStore, resolve_store_url
    from scheduler.cli.common import print_json, setup

    settings = setup()
    url = resolve_store_url(settings.policy.weights_url, settings.home)
    store = WeightStore(url, settings.policy.weights, keyring=keyring(settings))
    result: dict[str, object] = {"version": version, "ok": True, "checked": []}
    try:
        manifest = store.manifest(version)
        result["signed_by"] = manifest.signature.key_id if manifest.signature else None
        checked: list[str] = []
        if manifest.full:
            reader = store.open_full(version)
            for name in manifest.tensors:
                reader.words(name)
            checked.append("full")
        if manifest.delta:
            for name in manifest.tensors:
                store.words(version, name, [*store.chain(manifest.delta.base), manifest])
            checked.append("delta")
        result["checked"] = checked
    except WeightsError as err:
        result.update(ok=False, error=str(err))
    if as_json:
        print_json(result)
    else:
        typer.echo(f"{version}: {'ok' if result['ok'] else 'FAILED: ' + str(result.get('error'))}")
    if not result["ok"]:
        raise typer.Exit(1)


@weights_app.command("put")
def put(
    checkpoint: Path = typer.Argument(..., help="Hugging Face checkpoint directory (model.safetensors)."),
    version: str = typer.Option(None, help="Version id (default: the next sequence number)."),
    full: bool = typer.Option(None, "--full/--delta", help="Force or skip a full snapshot (default: every N)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Add a checkpoint to the store as the newest version (delta from the latest)."""
    from scheduler.cli.common import print_json, setup

    store = open_store(setup())
    manifest = store.put(checkpoint, version=version, full=full, meta={"source": str(checkpoint)})
    out = {
        "version": manifest.version,
        "parent": manifest.parent,
        "full_bytes": manifest.full.bytes if manifest.full else None,
        "delta_bytes": manifest.delta.bytes if manifest.delta else None,
    }
    print_json(out) if as_json else typer.echo(str(out))


@weights_app.command("keygen")
def keygen(
    rotate: bool = typer.Option(
        False, "--rotate", help="Replace the existing key with a new one (its public key is appended, not replaced)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Create the key that signs versions (policy.weights.signing_key, mode 0600) and append its public key to
    policy.weights.public_key, the file to give replicas. Without --rotate an existing key is kept."""
    from policy.weights import SigningKey
    from policy.weights.signing import public_pem
    from scheduler.cli.common import print_json, setup

    settings = setup()
    signer = SigningKey.from_config(settings.policy.weights, settings.home)
    created = rotate or not signer.exists()
    key = signer.create(replace=True) if rotate else signer.key()
    signer.publish()
    out = {
        "key_id": signer.key_id,
        "created": created,
        "signing_key": str(signer.path),
        "public_key_file": str(signer.public_path),
        "public_key": public_pem(key.public_key()).decode(),
        "trusted": sorted(keyring(settings).trusted()),
    }
    if as_json:
        print_json(out)
        return
    typer.echo(f"{'created' if created else 'kept'} signing key {out['key_id']} at {out['signing_key']}")
    typer.echo(f"replicas trust {out['trusted']} from {out['public_key_file']}; its public key:")
    typer.echo(str(out["public_key"]), nl=False)


@weights_app.command("sign")
def sign(
    versions: list[str] = typer.Argument(None, help="Versions to sign again (default with --all: every one)."),
    all_versions: bool = typer.Option(False, "--all", help="Every complete version of the store."),
    force: bool = typer.Option(
        False, "--force", help="Vouch for versions whose signature the trusted keys do not verify (unsigned ones)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Sign versions again with the current key (after `keygen --rotate`). Each is checked first: its current
    signature against policy.weights.public_key (unless --force), every artifact against its checksums."""
    from policy.weights import WeightsError
    from scheduler.cli.common import print_json, setup

    settings = setup()
    store = open_store(settings)
    names = [head.version for head in store.heads()] if all_versions else list(versions or [])
    if not names:
        raise typer.BadParameter("name the versions to sign, or pass --all")
    trusted = None if force else keyring(settings)
    signed: list[str] = []
    refused: dict[str, str] = {}
    for name in names:
        try:
            store.sign(name, trusted=trusted)
            signed.append(name)
        except WeightsError as err:
            refused[name] = str(err)
    out = {"key_id": store.signer.key_id if store.signer else None, "signed": signed, "refused": refused}
    if as_json:
        print_json(out)
    else:
        typer.echo(f"signed {signed} with key {out['key_id']}")
        for name, why in refused.items():
            typer.echo(f"refused {name}: {why}", err=True)
    if refused:
        raise typer.Exit(1)


@weights_app.command("gc")
def gc(
    keep: list[str] = typer.Option([], "--keep", help="A version some replica still holds (repeatable)."),
    retain: int = typer.Option(None, help="Keep the newest N versions (default: config retain_last)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would be deleted."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Delete versions no replica needs (held ones, the newest N and their chains are kept)."""
    from dataclasses import asdict

    from policy.weights import collect
    from scheduler.cli.common import print_json, setup

    settings = setup()
    store = open_store(settings)
    plan = collect(store, set(keep) | _in_use(settings), retain_last=retain, dry_run=dry_run)
    if as_json:
        print_json({"dry_run": dry_run, **asdict(plan)})
    else:
        typer.echo(f"kept {plan.keep}; {'would delete' if dry_run else 'deleted'} {plan.delete + plan.incomplete}")


@weights_app.command("serve")
def serve(
    host: str = typer.Option("127.0.0.1", help="Interface to bind (0.0.0.0 for replicas on other machines)."),
    port: int = typer.Option(8300, help="Port."),
    root: Path = typer.Option(None, help="Store directory (default: policy.weights_url under the home)."),
) -> None:
    """Serve the store read-only over HTTP; replicas then use http://HOST:PORT/ as their store URL."""
    import uvicorn

    from scheduler.cli.common import setup
    from serving.store_server import create_store_app

    settings = setup()
    if root is None:
        store = open_store(settings)
        if not store.is_local:
            raise typer.BadParameter(f"the store {store.url} is not a local directory; serve a directory with --root")
        root = Path(store.root)
    try:
        app = create_store_app(root)
    except FileNotFoundError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from err
    typer.echo(f"weight store {root} on http://{host}:{port}/ (read-only)", err=True)
    uvicorn.run(app, host=host, port=port, log_level=settings.log_level.lower(), access_log=False)


def register(app: typer.Typer) -> None:
    """Attach the ``weights`` group."""
    app.add_typer(weights_app, name="weights")
