"""The demo's parts: the fleet's load history, the developers' arrivals and retention, the production
trainer's batch plan (malformed, empty and hostile inputs included), and what triggers an update
(on both databases)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policy.production import plan_batches
from policy.rollouts import Rollout
from scheduler.demo.developers import arrival_schedule, retained_lines
from serving.control import load_rates


def test_load_rates_counts_requests_per_window_up_to_now() -> None:
    now = 1000.0
    stamps = [now - 25, now - 24, now - 5, now - 1]
    rates = load_rates(stamps, 10.0, now)
    assert rates.tolist() == pytest.approx([0.2, 0.0, 0.2])  # oldest first, ends now
    assert load_rates([], 10.0, now).size == 0
    with pytest.raises(ValueError, match="more than 0"):
        load_rates(stamps, 0.0, now)


def test_load_rates_ignores_stamps_from_the_future() -> None:
    rates = load_rates([990.0, 5000.0], 10.0, 1000.0)
    assert rates.sum() * 10.0 == pytest.approx(1.0)


def test_arrivals_follow_the_mean_rate_and_stay_in_the_span() -> None:
    rates = np.concatenate([np.full(72, 1.0), np.full(72, 3.0)])  # quiet night, busy day
    at = arrival_schedule(rates, 600.0, 0.5, np.random.default_rng(0))
    assert np.all(np.diff(at) >= 0) and at.min() >= 0 and at.max() < 600.0
    assert 0.4 * 600 < at.size < 0.6 * 600
    assert (at >= 300).sum() > 2 * (at < 300).sum()  # the busy half gets about 3x the arrivals


def test_retention_keeps_kept_code_and_deletes_failing_code() -> None:
    body = "    x = 1\n    return x\n"
    assert retained_lines(body, True, True, 20, 10, 1.0) == (2, 2)
    assert retained_lines(body, False, False, 20, 10, 1.0) == (2, 0)
    written, kept = retained_lines(body, False, True, 20, 80, 0.0)
    assert written == 2 and 0 <= kept <= written
    assert retained_lines("", False, False, 20, 0, 0.0)[0] == 1  # an empty answer still counts as written


def _rollout(group: str | None, sid: str) -> Rollout:
    return Rollout(prompt_ids=[1], completion_ids=[2], reward=0.0, group_id=group, session_id=sid)


def test_batch_plan_keeps_groups_whole_and_is_deterministic() -> None:
    rollouts = [_rollout(f"g{g}", f"g{g}-{i}") for g in range(5) for i in range(4)]
    rollouts += [_rollout(None, "single"), _rollout("lonely", "lonely-0")]  # no group baseline
    plan = plan_batches(rollouts, steps=3, groups_per_step=2, seed=7, singles=False)
    assert plan == plan_batches(rollouts, steps=3, groups_per_step=2, seed=7, singles=False)
    assert len(plan) == 3 and all(len(step) == 8 for step in plan)
    for step in plan:
        groups = {sid.rsplit("-", 1)[0] for sid in step}
        assert len(groups) == 2 and "single" not in step and "lonely-0" not in step
    assert plan_batches([_rollout(None, "a")], steps=2, groups_per_step=2, seed=0, singles=False) == []


def test_batch_plan_trains_single_sessions_and_keeps_a_sessions_windows_together() -> None:
    rollouts = [_rollout("g", f"g-{i}") for i in range(3)]
    rollouts += [_rollout(None, "single"), _rollout("lonely", "lonely-0")]
    rollouts += [_rollout(None, "agent"), _rollout(None, "agent")]  # two windows of one session
    plan = plan_batches(rollouts, steps=4, groups_per_step=4, seed=3)
    assert all(sorted(step) == sorted(["g-0", "g-1", "g-2", "single", "lonely-0", "agent"]) for step in plan)
    assert plan_batches([_rollout(None, "a")], steps=2, groups_per_step=2, seed=0) == [["a"], ["a"]]


def test_batch_plan_draws_labeled_groups_first_and_fills_with_scored_ones() -> None:
    rollouts = [_rollout(f"L{g}", f"L{g}-{i}") for g in range(3) for i in range(4)]  # rewarded by labels
    rollouts += [_rollout(f"M{g}", f"M{g}-{i}") for g in range(20) for i in range(4)]  # by the model
    labeled = {r.session_id for r in rollouts if r.session_id and r.session_id.startswith("L")}
    plan = plan_batches(rollouts, steps=4, groups_per_step=2, seed=5, first=labeled)
    drawn = [sid.rsplit("-", 1)[0] for step in plan for sid in step[::4]]
    assert len(drawn) == 8 and {g for g in drawn if g.startswith("L")} == {"L0", "L1", "L2"}
    assert sum(g.startswith("M") for g in drawn) == 5  # the draws the labels leave
    assert plan == plan_batches(rollouts, steps=4, groups_per_step=2, seed=5, first=labeled)
    # without the priority one shuffle decides: the three labeled groups are rarely all drawn
    unordered = [plan_batches(rollouts, steps=4, groups_per_step=2, seed=s) for s in range(20)]
    missed = sum(not {"L0-0", "L1-0", "L2-0"} <= {sid for step in p for sid in step} for p in unordered)
    assert missed > 10
    # only labeled groups (labels-only training): exactly the plan without the priority
    only = [r for r in rollouts if r.session_id in labeled]
    assert plan_batches(only, steps=4, groups_per_step=2, seed=5, first=labeled) == plan_batches(
        only, steps=4, groups_per_step=2, seed=5
    )
    # a group with one member scored by the model is not a labeled group
    for seed in range(10):
        (step,) = plan_batches(rollouts, steps=1, groups_per_step=2, seed=seed, first=labeled - {"L1-2"})
        assert {sid.rsplit("-", 1)[0] for sid in step} == {"L0", "L2"}


def test_batch_plan_caps_the_passes_over_short_data() -> None:
    rollouts = [_rollout(f"g{g}", f"g{g}-{i}") for g in range(5) for i in range(4)]
    uncapped = plan_batches(rollouts, steps=8, groups_per_step=2, seed=1)
    assert len(uncapped) == 8  # 16 draws of 5 groups: each drawn three or four times
    capped = plan_batches(rollouts, steps=8, groups_per_step=2, seed=1, max_epochs=2)
    assert len(capped) == 5 and capped == uncapped[:5]  # ceil(2 x 5 / 2) steps: each group twice
    drawn = [sid.rsplit("-", 1)[0] for step in capped for sid in step[::4]]
    assert sorted(drawn) == sorted([f"g{g}" for g in range(5)] * 2)
    plenty = [_rollout(f"h{g}", f"h{g}-{i}") for g in range(40) for i in range(4)]
    assert plan_batches(plenty, steps=8, groups_per_step=2, seed=1, max_epochs=2) == plan_batches(
        plenty, steps=8, groups_per_step=2, seed=1
    )  # enough data: the cap changes nothing
    assert len(plan_batches([_rollout(None, "a")], steps=4, groups_per_step=8, seed=0, max_epochs=0.5)) == 1


def test_the_update_trigger_counts_candidate_groups_and_groups_of_agent_sessions(engine: Any, tmp_path: Path) -> None:
    """The demo submits an update once enough trainable groups were stored: the K choices of one request
    and the parallel agent sessions on one task (stored one row per turn, the group in ``turn.group``)
    count once each; a session alone (a tab completion, an agent session without a group) does not.
    The events go through the wire contract and the consumer's writer, so the rows are stored as ingest
    stores them."""
    from types import SimpleNamespace

    from ingest.db import transaction
    from ingest.schemas import validate_event
    from ingest.synthetic import flat_session
    from ingest.writer import write_events
    from scheduler.demo.run import DemoOptions, Orchestrator
    from scheduler.settings import Settings

    n = iter(range(100))

    def event(**payload: Any) -> dict[str, Any]:
        e = flat_session(next(n), seed=5, n_tokens=4)
        e["payload"].update(payload)
        return e

    def store(events: list[dict[str, Any]]) -> None:
        with transaction(engine) as session:
            write_events(session, [validate_event(e) for e in events])

    events = [event(group_id="grp-req", candidate_index=i) for i in range(4)]  # one request's 4 choices
    events += [event()]  # a completion alone
    for agent in ("a1", "a2"):  # two parallel agent sessions on one task, two turns each
        events += [event(turn={"session_id": agent, "index": t, "group": "grp-task"}) for t in range(2)]
    events += [event(turn={"session_id": "solo", "index": 0})]  # an agent session without a group
    store(events)
    orch = Orchestrator(Settings(home=tmp_path), SimpleNamespace(engine=engine), DemoOptions())
    assert orch.groups() == 2
    store([event(turn={"session_id": "b", "index": 0, "group": "grp-other"})])
    assert orch.groups() == 3


def test_the_report_prints_each_gain_beside_its_own_figure_and_the_target_on_gain_points() -> None:
    """The terminal headline: the task-success line carries the task-success gain (not ``gain_points``,
    which is the true utility's under the population), and the +10 target sits on the measure
    ``gain_points`` is taken from; a version's reward-model cell says which model scored it and what
    its retrain registered."""
    from rich.console import Console

    from scheduler.demo.report import print_report

    version = {
        "version": "v0001", "label": "update", "heldout_task_success": 0.3, "heldout_retention": 0.4,
        "heldout_acceptance": 0.5, "online_requests": 10, "online_acceptance": 0.6, "rollout": "succeeded",
        "rollout_message": "", "reward_model": "rm-0001-aa", "reward_model_scored": 42.0,
        "reward_model_trained": "rm-0002-bb", "reward_model_trained_status": "candidate", "reward_model_metric": 0.42,
    }  # fmt: skip
    report = {
        "minutes": 9.0, "versions": [version], "final_version": "v0001", "rollbacks": 0, "failed_updates": [],
        "v0_heldout_task_success": 0.2, "final_heldout_task_success": 0.3, "task_success_gain_points": 10.0,
        "mean_turns": 3.0, "sessions_with_summary": 5, "v0_heldout_true_utility": 0.25,
        "final_heldout_true_utility": 0.33, "true_utility_gain_points": 8.0, "gain_points": 8.0,
        "gain_measured_on": "heldout_true_utility", "v0_heldout_retention": 0.3, "final_heldout_retention": 0.4,
        "retention_gain_points": 10.0,
    }  # fmt: skip
    console = Console(record=True, width=400)
    print_report(report, console)
    lines = console.export_text().splitlines()
    task = next(line for line in lines if line.startswith("agent held-out task success"))
    truth = next(line for line in lines if line.startswith("held-out true utility"))
    assert "(+10.0 points)" in task and "target" not in task
    assert "(+8.0 points; gain_points, target +10" in truth
    assert any("scored 42 with rm-0001-aa; trained rm-0002-bb (candidate 0.420)" in line for line in lines)


def _loop_jobs(engine: Any) -> list[str]:
    """Ids of the loop jobs recorded in the database, sorted."""
    from sqlalchemy import select

    from scheduler.tables import JobRow

    with engine.connect() as conn:
        return sorted(conn.scalars(select(JobRow.id).where(JobRow.name == "loop")))


def test_an_update_that_just_finished_slower_than_all_before_it_keeps_the_next_from_overrunning(
    engine: Any, tmp_path: Path
) -> None:
    """The demo submits an update only when one could finish before the traffic phase ends, judged by
    the slowest update so far. The update collected in the same poll counts: on a slow machine the
    third update waited 80 s for a replica to borrow and took 199 s, and a next one submitted on the
    earlier 65 s estimate ran two minutes past the traffic phase. The submission is the real one: the
    job recorded in the database and queued on the default broker (the SQLAlchemy transport on it)."""
    import time
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from ingest.db import transaction
    from scheduler.demo.run import DemoOptions, Orchestrator
    from scheduler.settings import Settings
    from scheduler.tables import JobRow

    now = datetime.now(UTC)
    with transaction(engine) as s:
        s.add(JobRow(id="update-1", name="loop", state="SUCCESS", inputs={}, outputs={}, created_at=now))
    opts = DemoOptions(min_new_groups=0, drill=False)
    settings = Settings(home=tmp_path, database_url=engine.url.render_as_string(hide_password=False))
    orch = Orchestrator(settings, SimpleNamespace(engine=engine), opts)
    orch.outcomes = [{"kind": "update", "seconds": 65.0}]
    orch.inflight, orch.inflight_kind, orch.inflight_since = "update-1", "update", time.monotonic() - 199.0

    assert orch.poll(left_s=100.0) == "no new updates (end of the traffic phase)"
    assert _loop_jobs(engine) == ["update-1"] and orch.inflight is None
    assert orch.expected_chain_s() >= 199.0
    assert orch.poll(left_s=250.0) == "update submitted"
    queued = [j for j in _loop_jobs(engine) if j != "update-1"]
    assert len(queued) == 1 and queued[0].startswith("update-") and orch.inflight == queued[0]


def test_no_update_is_submitted_near_the_end_while_the_planner_lends_no_replica(engine: Any, tmp_path: Path) -> None:
    """At the trace's peak the capacity planner lends no replica: every one serves users. An update
    submitted then waits for one, and on a slow machine such a wait (48 s) was longer than any finished
    update's, so an update submitted on a 77 s estimate with 94 s left ran 78 s past the traffic phase.
    The demo asks the planner (a fleet at 10x one replica's capacity lends nothing, one at half lends)
    and counts the wait: the longest stretch without a replica so far or the current one's age."""
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from scheduler_helpers import FileFleet
    from sqlalchemy import update

    from ingest.db import transaction
    from scheduler.demo.run import DemoOptions, Orchestrator
    from scheduler.settings import SchedulerConfig, Settings
    from scheduler.tables import JobRow

    def set_load(rps: float) -> None:
        with fleet._edit() as state:
            state["load_rps"] = rps

    fleet = FileFleet.create(tmp_path, n=3, load_rps=1000.0)  # 100 rps a replica: all three serve
    settings = Settings(
        home=tmp_path,
        database_url=engine.url.render_as_string(hide_password=False),
        scheduler=SchedulerConfig(fleet_control="scheduler_helpers:fleet", preempt_resume_s=3.0),
    )
    orch = Orchestrator(
        settings, SimpleNamespace(engine=engine), DemoOptions(min_new_groups=0, drill=False, lend_check_s=0)
    )
    orch.outcomes = [{"kind": "update", "seconds": 65.0}]

    assert not orch.planner_lends()
    orch.observe_lending()
    assert orch.no_lend_since is not None
    orch.no_lend_since -= 60.0  # no replica for the last minute
    status = orch.poll(left_s=100.0)
    assert status.startswith("no new updates (no replica can be lent now; a wait of about 6"), status
    assert _loop_jobs(engine) == [] and orch.inflight is None

    set_load(50.0)  # the peak passed: the planner lends again, and the stretch is remembered
    assert orch.poll(left_s=100.0) == "update submitted"
    assert len(_loop_jobs(engine)) == 1 and orch.inflight == _loop_jobs(engine)[0]
    assert orch.longest_no_lend_s >= 60.0 and orch.no_lend_since is None
    with transaction(engine) as s:
        s.execute(
            update(JobRow).where(JobRow.id == orch.inflight).values(state="SUCCESS", finished_at=datetime.now(UTC))
        )

    set_load(1000.0)  # a second peak: its stretch has only begun, the first one's length counts
    assert orch.poll(left_s=100.0).startswith("no new updates (no replica can be lent now")
    assert len(_loop_jobs(engine)) == 1 and len(orch.outcomes) == 2 and orch.inflight is None
    assert orch.poll(left_s=200.0) == "update submitted"  # time enough for the wait and the update
    assert len(_loop_jobs(engine)) == 2


def test_the_demo_canary_moves_two_of_three_replicas_and_never_the_whole_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deployer the demo's settings configure stages a canary of two replicas of three, then the
    rest; a pool of two (or one) keeps a canary of one, so the current version always serves beside it."""
    from scheduler.demo.run import DemoOptions, _env
    from scheduler.settings import load_settings
    from serving.deploy import stage_sizes

    for replicas, asked, stages in ((3, 2, [2, 3]), (2, 2, [1, 2]), (1, 2, [1]), (3, 1, [1, 3])):
        env = _env(tmp_path, DemoOptions(replicas=replicas, canary_replicas=asked), 240.0)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        deploy = load_settings().serving.deploy
        assert stage_sizes(replicas, deploy) == stages, (replicas, asked)
