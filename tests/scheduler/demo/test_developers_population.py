"""The demo's developers drawn from the population: what goes over the wire is exactly what the
population decided, mapped onto the served sessions' ids; delays are compressed like the day and
signals due after the run are counted, not sent; true utility is logged apart and never sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request

from scheduler.demo.developers import DeveloperConfig, Developers
from scheduler.demo.population import Outcome, PopulationConfig

SPEEDUP = 36000.0  # 1 h of simulated time = 0.1 s; 1 day = 2.4 s (after the drain); 1 week later still


def _recorder() -> tuple[FastAPI, list[dict[str, Any]]]:
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.post("/v1/signals", status_code=202)
    async def signals(request: Request) -> dict[str, bool]:
        seen.append(await request.json())
        return {"accepted": True}

    return app, seen


def _developers(tmp_path: Path) -> Developers:
    config = DeveloperConfig(population=PopulationConfig(users=12), drain_s=0.6)
    rates = np.ones(144)
    return Developers("http://gw", None, rates, 60.0, SPEEDUP, config, seed=3, utility_log=tmp_path / "u.jsonl")


def _outcomes(i: int) -> list[Outcome]:
    kinds = [(True, True), (True, False), (False, False), (i % 2 == 0, i % 2 == 0)]
    return [Outcome(passed=p, kept=k, lines=4 + j, size=40, size_limit=50) for j, (p, k) in enumerate(kinds)]


def test_signals_carry_the_populations_decisions_on_the_served_ids(tmp_path: Path) -> None:
    devs = _developers(tmp_path)
    app, seen = _recorder()
    groups = {}

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            for i in range(40):
                user = devs.population.draw(devs.rng).user_id  # type: ignore[union-attr]
                ids = [f"s{i}-{j}" for j in range(4)]
                groups[f"g{i}"] = (ids, user)
                devs._react(http, user, _outcomes(i), ids, ["v0001"] * 4, f"g{i}")
            single = devs.population.draw(devs.rng).user_id  # type: ignore[union-attr]
            devs._react(
                http, single, [Outcome(passed=False, kept=False, lines=0, submitted=False)], ["a"], ["v0002"], None
            )
            await devs._drain()

    asyncio.run(main())
    assert seen, "no signal was sent"
    by_type: dict[str, list[dict[str, Any]]] = {}
    for body in seen:
        by_type.setdefault(body["type"], []).append(body)
        assert "utility" not in json.dumps(body["payload"])  # the truth never goes over the wire
    for body in by_type["candidates.shown"]:
        ids, user = groups[body["payload"]["group_id"]]
        assert body["payload"]["session_ids"] == ids and body["session_id"] == ids[0] and body["user_id"] == user
    assert len(by_type["candidates.shown"]) == 40  # the client's display telemetry always arrives
    for body in by_type.get("candidate.selected", []):
        ids, _user = groups[body["payload"]["group_id"]]
        assert body["payload"]["chosen_session_id"] == body["session_id"] and body["session_id"] in ids
    assert 0 < len(by_type.get("candidate.selected", [])) < 40  # partial: only some users report a pick
    horizons = {b["payload"]["horizon_s"] for b in by_type.get("code.retained", [])}
    assert horizons == {3600}  # the day's and the week's retention would arrive after the run
    assert devs.stats.signals_late > 0 and devs.stats.signals == len(seen)
    rows = [json.loads(line) for line in (tmp_path / "u.jsonl").read_text().splitlines()]
    assert len(rows) == 40 * 4 + 1 and all(0.0 <= r["utility"] <= 1.0 for r in rows)
    assert {r["version"] for r in rows} == {"v0001", "v0002"}
    assert sum(devs.stats.judged_by_version.values()) == 41
    taken = [r for r in rows if r["taken"]]
    assert sum(devs.stats.utility_by_version.values()) == pytest.approx(sum(r["utility"] for r in taken), abs=1e-4)
