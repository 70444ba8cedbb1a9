"""The synthetic telemetry: contract-valid, seeded, shaped by the ServeGen trace, signals tied to quality."""

from __future__ import annotations

import json

import numpy as np
from ingest_helpers import DATA

from ingest.schemas import parse_event
from ingest.synthetic import HORIZONS_S, arrival_times, generate, load_rates


def test_every_event_is_valid_and_seeded() -> None:
    rates = load_rates(DATA / "servegen_m_small_day0.csv")
    a = generate(150, seed=4, rates=rates)
    b = generate(150, seed=4, rates=rates)
    assert [it.event for it in a.items] == [it.event for it in b.items]
    assert [it.event["event_id"] for it in generate(150, seed=5, rates=rates).items] != [
        it.event["event_id"] for it in a.items
    ]
    for item in a.items:
        parse_event(json.dumps(item.event).encode())
    kinds = a.counts_by_type()
    for kind in ("session.completed", "candidates.shown", "candidate.selected", "code.retained", "edit.accepted"):
        assert kinds.get(kind, 0) > 0, kind
    horizons = {it.event["payload"]["horizon_s"] for it in a.items if it.event["type"] == "code.retained"}
    assert horizons == set(HORIZONS_S)
    assert 0 < sum(it.duplicate for it in a.items) < len(a.items) * 0.05
    assert a.distinct_events == len(a.items) - sum(it.duplicate for it in a.items)
    assert [it.at_s for it in a.items] == sorted(it.at_s for it in a.items)


def test_late_retention_and_early_signals() -> None:
    tele = generate(300, seed=1, late_session_share=0.2)
    arrived_at: dict[str, float] = {}
    early = 0
    for item in tele.items:
        ev = item.event
        if ev["type"] == "session.completed":
            arrived_at.setdefault(ev["session_id"], item.at_s)
        elif ev.get("session_id") and ev["session_id"] not in arrived_at:
            early += 1
    assert early > 0
    day = [it for it in tele.items if it.event["type"] == "code.retained" and it.event["payload"]["horizon_s"] == 86400]
    assert min(it.at_s - arrived_at[it.event["session_id"]] for it in day) > 80000


def test_signals_follow_hidden_quality() -> None:
    tele = generate(1500, seed=2, with_experts=False)
    kept: dict[str, float] = {}
    for it in tele.items:
        p = it.event["payload"]
        if it.event["type"] == "code.retained" and p["horizon_s"] == 3600 and p["lines_written"]:
            kept[it.event["session_id"]] = p["lines_retained"] / p["lines_written"]
    q = np.array([tele.quality[s] for s in kept])
    r = np.array(list(kept.values()))
    assert np.corrcoef(q, r)[0, 1] > 0.3
    chosen = {
        it.event["payload"]["group_id"]: it.event["payload"]["chosen_session_id"]
        for it in tele.items
        if it.event["type"] == "candidate.selected"
    }
    groups = {
        it.event["payload"]["group_id"]: it.event["payload"]["session_ids"]
        for it in tele.items
        if it.event["type"] == "candidates.shown"
    }
    assert chosen.keys() == groups.keys()
    best = sum(tele.quality[c] == max(tele.quality[s] for s in groups[g]) for g, c in chosen.items())
    chance = float(np.mean([1 / len(groups[g]) for g in groups]))
    assert best / len(chosen) > chance + 0.1


def test_arrivals_follow_the_trace() -> None:
    rates = np.array([1.0] * 72 + [3.0] * 72)  # the second half of the day is three times busier
    times = arrival_times(20000, rates, 86400.0, np.random.default_rng(0))
    late = (times >= 43200).mean()
    assert 0.72 < late < 0.78
    assert times.min() >= 0 and times.max() < 86400
