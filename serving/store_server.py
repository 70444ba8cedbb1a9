"""The weight store served read-only over HTTP, for replicas that do not share its filesystem.

A replica opens ``http://host:port/`` like any other store URL (:class:`policy.weights.WeightStore`
over fsspec's HTTP filesystem): manifests and the heads file with GET, sizes with HEAD, a delta
in one GET and a snapshot's tensors with byte-range requests. This server is Starlette's static
files on the store's root directory: GET and HEAD only, byte ranges, no directory listings and
nothing outside the root. A version is visible once its manifest is (the store writes the
manifest last), so a replica never reads a version that is still being written.

Production puts the store on object storage (``s3://``, ``gs://`` with their fsspec packages);
this is the same protocol for a fleet without one, and what the deployment benchmark puts
across a network link. Started by ``undertow weights serve``.
"""

from __future__ import annotations

import html
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles


def create_store_app(root: Path) -> Starlette:
    """A read-only HTTP view of the store at ``root`` (which must exist)."""
    root = Path(root).resolve()
    if not (root / "versions").is_dir():
        raise FileNotFoundError(f"{root} is not a weight store (no versions/ directory); publish a version first")

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "versions": sum(1 for _ in (root / "versions").glob("*/manifest.json"))})

    async def versions(_: Request) -> HTMLResponse:
        names = sorted(p.name for p in (root / "versions").iterdir() if p.is_dir())
        links = "".join(f'<a href="{html.escape(name)}/">{html.escape(name)}/</a>\n' for name in names)
        return HTMLResponse(f"<!doctype html><title>versions</title>\n{links}")

    files = StaticFiles(directory=root, html=False, follow_symlink=False)
    return Starlette(
        routes=[
            Route("/-/health", health),
            Route("/versions", versions),
            Route("/versions/", versions),
            Mount("/", app=files),
        ]
    )
