"""The dashboards in a real headless Chromium (Debian's package, driven by Playwright): log in
with a viewer token (a bad one is refused), every page loads, every chart renders with data, no console errors or
failed requests; a screenshot of each page goes to ``test-artifacts/``.

Skips with the reason when no Chromium is installed (``apt-get install chromium``; never a
browser downloaded by ``playwright install``).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import Seeded, make_settings
from sqlalchemy.engine import Engine

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Page -> charts it must show with data (SVG ids of the series each chart draws).
PAGES = {
    "/": ["series-v0", "series-proxy"],
    "/rewards": ["series-v3", "series-v0", "series-v2"],
    "/models": ["series-proxy"],
    "/fleet": ["series-capacity"],
    "/jobs": ["series-job-seed-job-00"],
}

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def live_url(shared_url: str, api_engine: Engine, api_home: Path, seeded: Seeded) -> Iterator[str]:
    """The app served by uvicorn on a free loopback port (real HTTP, real database)."""
    import uvicorn

    from ingest.embedded import free_port
    from scheduler.api.app import create_app

    if not shared_url.startswith("sqlite"):
        pytest.skip("the browser checks run once, on the SQLite database")
    port = free_port()
    app = create_app(make_settings(api_home, shared_url), engine=api_engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_every_dashboard_renders_its_charts_without_errors(live_url: str, tokens: dict[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    problems: list[str] = []
    timings: dict[str, float] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        check_login_form(browser, live_url, tokens["viewer"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on(
            "console",
            lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None,
        )
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
        page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)

        # Not logged in: any page sends the browser to the login form, which returns it there.
        page.goto(f"{live_url}/rewards")
        assert "/login" in page.url
        page.fill("#token", tokens["viewer"])
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_url}/rewards")
        page.screenshot(path=str(ARTIFACTS / "dashboard-login-redirect.png"))

        for path, series in PAGES.items():
            started = time.perf_counter()
            page.goto(f"{live_url}{path}", wait_until="load")
            timings[path] = time.perf_counter() - started
            charts = page.locator("svg.chart")
            assert charts.count() >= 1, path
            for sid in series:
                assert page.locator(f'svg.chart [id="{sid}"]').count() >= 1, f"{path}: no series {sid}"
            assert page.locator("svg.chart #nodata").count() == 0, f"{path}: a chart has no data"
            assert page.evaluate("document.querySelector('link[rel=icon]') !== null")
            name = path.strip("/") or "overview"
            page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)

        # Filters re-render the charts for another signal.
        page.goto(f"{live_url}/rewards")
        page.select_option("select[name=signal]", "acceptance")
        page.click("form.filters button")
        page.wait_for_url("**signal=acceptance**")
        assert "acceptance by policy version" in page.inner_text("main")
        assert page.locator('svg.chart [id="series-v1"]').count() >= 1

        page.click("header form button")  # log out
        page.wait_for_url("**/login")
        browser.close()
    (ARTIFACTS / "dashboard-timings.txt").write_text("".join(f"{p} {t:.3f}s\n" for p, t in timings.items()))
    assert not problems, "\n".join(problems)
    # Demo-sized data renders in about a second; the bound is loose for loaded CI machines.
    assert max(timings.values()) < 8.0, timings


def check_login_form(browser: Any, live_url: str, token: str) -> None:
    """A bad token is refused on the form; a good one sets an HttpOnly, SameSite=Strict cookie;
    ``next`` never sends the browser to another site."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{live_url}/login?next=//evil.example/steal")
    page.fill("#token", "ut_wrong")
    page.click("button[type=submit]")
    assert "Unknown or revoked token" in page.inner_text("main")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.url == f"{live_url}/"
    cookie = next(c for c in context.cookies() if c["name"] == "undertow_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    context.close()
