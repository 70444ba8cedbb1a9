"""The weight store served read-only over HTTP, for replicas that do not share its filesystem.

A replica opens ``http://host:port/`` like any other store URL (:class:`policy.weights.WeightStore`
over fsspec's HTTP filesystem): manifests and the heads file with GET, sizes with HEAD, a delta
in one GET and a snapshot's tensors with byte-range requests. This server is Starlette's static
files behind a gate: GET and HEAD only, byte ranges, and only the artifacts of complete versions
(``versions/<id>/`` with its ``manifest.json``: the manifest, the delta, the snapshot). A version
whose manifest is not written yet (the store writes it last) is in no listing and none of its
files is served, so a replica never reads a version that is still being written, and nothing
else under the root (temporary files, anything put there by mistake) leaves the machine.

The server does not check signatures: replicas do, with their own public keys (a server that
judged them would only move the trust to whoever reaches it).

Production puts the store on object storage (``s3://``, ``gs://`` with their fsspec packages);
this is the same protocol for a fleet without one, and what the deployment benchmark puts
across a network link. Started by ``undertow weights serve``.
"""

from __future__ import annotations

import html
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from policy.weights.format import DELTA_FILE, FULL_FILE, MANIFEST, VERSION_RE

ARTIFACTS = frozenset({MANIFEST, DELTA_FILE, FULL_FILE})
"""The only files of a version directory that are served."""


def create_store_app(root: Path) -> Starlette:
    """A read-only HTTP view of the complete versions of the store at ``root`` (which must exist)."""
    root = Path(root).resolve()
    versions_dir = root / "versions"
    if not versions_dir.is_dir():
        raise FileNotFoundError(f"{root} is not a weight store (no versions/ directory); publish a version first")

    def complete(name: str) -> bool:
        return bool(VERSION_RE.match(name)) and (versions_dir / name / MANIFEST).is_file()

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "versions": sum(1 for p in versions_dir.iterdir() if complete(p.name))})

    async def versions(_: Request) -> HTMLResponse:
        names = sorted(p.name for p in versions_dir.iterdir() if complete(p.name))
        links = "".join(f'<a href="{html.escape(name)}/">{html.escape(name)}/</a>\n' for name in names)
        return HTMLResponse(f"<!doctype html><title>versions</title>\n{links}")

    files = StaticFiles(directory=versions_dir, html=False, follow_symlink=False)

    async def artifacts(scope: Scope, receive: Receive, send: Send) -> None:
        """``/versions/<id>/<artifact>`` of a complete version, else 404 (nothing else is looked up)."""
        parts = scope["path"].removeprefix(scope.get("root_path", "")).lstrip("/").split("/")
        if len(parts) != 2 or parts[1] not in ARTIFACTS or not complete(parts[0]):
            await PlainTextResponse("Not Found", status_code=404)(scope, receive, send)
            return
        await files(scope, receive, send)

    return Starlette(
        routes=[
            Route("/-/health", health),
            Route("/versions", versions),
            Route("/versions/", versions),
            Mount("/versions", app=artifacts),
        ]
    )
