"""The closed loop end to end (``undertow demo``): developers use the assistant, their signals
train reward models and new policy versions, and the versions roll out through the canary gate.

Timeline: settings for this run (a fresh directory under ``<home>/demo``, env for the child
processes) -> v0 (cached warm-up) -> the stack (:class:`scheduler.demo.stack.DemoStack`) -> the
traffic phase: simulated developers (:mod:`scheduler.demo.developers`) replay one day of the
ServeGen trace compressed into ``minutes``; whenever enough new groups (candidate groups, parallel
agent sessions) were stored and no update is running, the orchestrator submits the loop as one
Celery chain (``collect -> retrain -> rl_update -> snapshot -> canary -> promote -> evaluate``) to
the worker, which borrows a replica through the planner (only when the forecast of the trace's next
window leaves one to lend), trains on production rollouts, stores the version as a delta, and
deploys it through the gate. Once, after a version was promoted, a **gate drill** submits an update
with a destructive learning rate: its answers degenerate (repetition to the token limit) and its
acceptance collapses, and the gate must roll it back. The updates skip the held-out evaluation (it
costs more than their training and would hold up the next update): once the traffic phase is over,
every version but the drill's (not meant to serve) is evaluated in parallel processes
(:mod:`scheduler.demo.heldout`). By default (``population``) the developers are drawn from
:mod:`scheduler.demo.population` (partial, noisy, late signals) and every version is also scored by
their true utility; ``population=False`` (``--deterministic``) gives developers who follow the
checker's rule. At the end: a table per version (held-out keep rate = retention, held-out pass rate =
acceptance, online acceptance, reward model, rollout outcome) and one JSON object.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from scheduler.demo.heldout import DRILL_LABEL

if TYPE_CHECKING:
    from scheduler.loop.borrowing import FleetControl
    from scheduler.settings import Settings

log = structlog.get_logger(__name__)


DEMO_MIXES: dict[int, tuple[float, float, float]] = {
    1: (0.45, 0.40, 0.15),
    2: (0.35, 0.50, 0.15),
    3: (0.30, 0.55, 0.15),
}
"""The demo's warm-up corpus: 15% wrong solutions per tier where :data:`policy.sft.MIXES` has 30%. With
30%, v0's held-out true utility is a draw of 20 to 26% on an AVX2 machine (seeds 0 to 2), and its updates
gained about a point each (+3.5 in a run); with 15%, v0 at 43.2% and runs of +13.0, +13.5 and +18.4
there (docs/BENCHMARKS.md). The tokenizer and the ablation keep :data:`policy.sft.MIXES`."""


@dataclass
class DemoOptions:
    """Sizes and budgets of one demo run (the smoke test shrinks them)."""

    minutes: float = 6.0
    """Wall-clock minutes of the traffic phase (one simulated day); setup, the last update's gate and
    the report come on top."""
    seed: int = 0
    """Seed of the developers, the arrivals and the trainer."""
    keep_running: bool = False
    """Leave the stack up after the report until Ctrl-C."""
    replicas: int = 3
    """CPU engine replicas."""
    mean_rps: float = 0.6
    """Mean wall-clock request rate of the developers (the trace's daily shape around it)."""
    sft_steps: int = 1200
    """Warm-up steps of v0 (only when no cached v0 exists)."""
    sft_agent_every: int = 2
    """Every this many warm-up steps, one trains on scripted agent transcripts (0: completions only)."""
    sft_mixes: dict[int, tuple[float, float, float]] = field(default_factory=lambda: dict(DEMO_MIXES))
    """The warm-up corpus's concise, verbose and wrong shares per tier (:data:`DEMO_MIXES`)."""
    eval_per_tier: int = 16
    """Held-out tasks per tier in the evaluation (3 tiers)."""
    eval_samples: int = 4
    """Samples per held-out task."""
    agent_eval_per_tier: int = 16
    """Held-out tasks per tier given agent sessions in the evaluation (0: no agent evaluation)."""
    agent_eval_samples: int = 4
    """Agent sessions per held-out task."""
    eval_after: bool = True
    """Evaluate the versions on the held-out set after the traffic phase (:mod:`scheduler.demo.heldout`,
    ``eval_workers`` processes) instead of inside each update, where it held up the next one."""
    eval_workers: int = 2
    """Processes evaluating versions at once after the traffic phase."""
    agent_share: float = 0.6
    """Share of the developers' arrivals handed to the agent (multi-turn sessions with tools)."""
    agent_group: int = 2
    """Agent sessions run in parallel on one task (a GRPO group)."""
    population: bool = True
    """Developers drawn from the population of users (:mod:`scheduler.demo.population`: tastes differ,
    signals are partial, noisy and late), scored by their true utility; False: the deterministic
    developers (the checker's rule)."""
    steps_per_version: int = 16
    """GRPO steps of one update."""
    rl_lr: float = 3e-4
    """Learning rate of the updates (AdamW)."""
    groups_per_step: int = 8
    """Candidate groups per GRPO step."""
    kl_coef: float = 0.05
    """KL to v0 in every update (``policy.kl_coef``): without it one update of the population's few,
    noisy labels lost 13 points on held-out templates while users saw no difference (docs/BENCHMARKS.md)."""
    max_epochs: float = 2.0
    """Passes over its rewarded groups an update takes at most (``policy.rl_max_epochs``)."""
    min_new_groups: int = 8
    """New groups stored (candidate groups and groups of agent sessions) before the next update is
    submitted."""
    drill: bool = True
    """Run the gate drill (a deliberately destructive update) once a version was promoted."""
    drill_lr: float = 0.05
    """Learning rate of the gate drill's update (destructive on purpose)."""
    gate_min_requests: int = 16
    """Requests a new version must serve before its stage is judged."""
    gate_min_judged: int = 6
    """Sessions users must have judged (signals of the acceptance proxy) before a stage is judged: the
    population signals on few sessions, and a canary nobody judged must not pass."""
    canary_replicas: int = 2
    """Replicas a new version's canary stage moves (at most all but one). What bounds the users a bad
    version reaches is the gate's minimum sample (``gate_min_requests``, ``gate_min_judged``), not the
    canary's share: two replicas of three reach that sample in about half the time of one, and the
    canary's wait was most of an update's time (docs/BENCHMARKS.md)."""
    lend_check_s: float = 5.0
    """How often the demo asks the capacity planner whether it would lend a replica (the estimate of an
    update's wait for one)."""
    expected_update_s: float = 90.0
    """Expected duration of one update (train, store, canary, gate) before one was measured: no update
    is submitted when it could not finish within the traffic phase."""
    finish_grace_s: float = 240.0
    """Longest wait past the traffic phase for the update in flight to finish."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra ``UNDERTOW_*`` settings for this run."""


def eval_fields(opts: DemoOptions) -> dict[str, int]:
    """The held-out evaluation of every version (``policy.evaluate.EvalConfig`` fields)."""
    return {
        "per_tier": opts.eval_per_tier,
        "samples_per_task": opts.eval_samples,
        "agent_per_tier": opts.agent_eval_per_tier,
        "agent_samples": opts.agent_eval_samples,
    }


def _retention_weights(opts: DemoOptions) -> dict[str, float]:
    """Retention horizons the labels weigh: the population's (1 h, 1 day, 1 week of simulated time: the
    first reaches the next update, the others mostly arrive after it) or the deterministic developers'
    (1, 10, 60 minutes)."""
    if opts.population:
        from scheduler.demo.population import PopulationConfig

        horizons = PopulationConfig().horizons_s
    else:
        horizons = (60, 600, 3600)
    return {str(h): float(2**i) for i, h in enumerate(horizons)}


def _env(home: Path, opts: DemoOptions, speedup: float) -> dict[str, str]:
    from ingest.embedded import free_port
    from ingest.signing import new_secret
    from serving.keys import KEY_PREFIX

    env = {
        "UNDERTOW_HOME": str(home),
        "UNDERTOW_LOG_LEVEL": os.environ.get("UNDERTOW_LOG_LEVEL", "WARNING"),
        "UNDERTOW_SCHEDULER__CLOCK_SPEEDUP": f"{speedup:.6f}",
        "UNDERTOW_SCHEDULER__PREEMPT_RESUME_S": "3",
        "UNDERTOW_SCHEDULER__CHECKPOINT_EVERY_STEPS": "2",
        "UNDERTOW_SCHEDULER__MIN_SERVING_REPLICAS": "1",
        "UNDERTOW_SERVING__GATEWAY_PORT": str(free_port()),
        "UNDERTOW_API__PORT": str(free_port()),
        "UNDERTOW_SERVING__DEPLOY__STAGES": "[1.0]",
        "UNDERTOW_SERVING__DEPLOY__CANARY_REPLICAS": str(max(1, min(opts.canary_replicas, opts.replicas - 1))),
        "UNDERTOW_SERVING__DEPLOY__GATE_MIN_REQUESTS": str(opts.gate_min_requests),
        "UNDERTOW_SERVING__DEPLOY__GATE_MIN_JUDGED": str(opts.gate_min_judged),
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_WAIT_S": "120",
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_LATENCY_RATIO": "3.0",
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_ACCEPTANCE_DROP": "0.2",
        "UNDERTOW_SERVING__DEPLOY__GATE_MAX_ERROR_RATE_DELTA": "0.05",
        "UNDERTOW_SERVING__GATEWAY__FLEET_REFRESH_S": "0.5",
        # the loop's deployer reads /gateway/metrics with this key; the gateway and the replay sign
        # what they write, and ingest refuses anything unsigned
        "UNDERTOW_SERVING__GATEWAY__METRICS_KEY": KEY_PREFIX + new_secret(),
        "UNDERTOW_INGEST__SIGNING_KEYS": json.dumps({"gateway": new_secret(), "dlq-replay": new_secret()}),
        # the engines' control routes (pause, sleep, weight RPCs) answer only the deployer, health checks and
        # borrowing, which send this token; the weights are signed with a key made in this fresh home
        "UNDERTOW_SERVING__FLEET__CONTROL_TOKEN": new_secret(),
        # simulated time runs `speedup` times faster than the wall clock, and so do the users
        "UNDERTOW_SERVING__GATEWAY__USER_RATE_PER_S": f"{2.0 * max(1.0, speedup):.3f}",
        "UNDERTOW_SERVING__GATEWAY__USER_SIGNAL_RATE_PER_S": f"{max(1.0, speedup):.3f}",
        "UNDERTOW_SERVING__FLEET__HEALTH_INTERVAL_S": "1.0",
        "UNDERTOW_SERVING__ENGINE__THREADS": "1",
        "UNDERTOW_REWARDS__RETENTION_WEIGHTS": json.dumps(_retention_weights(opts)),
        "UNDERTOW_REWARDS__RETENTION_GRACE_S": "60",
        "UNDERTOW_REWARDS__RETRAIN_MIN_NEW_LABELS": "60",
        "UNDERTOW_REWARDS__MIN_TRAIN_ROWS": "20",
        "UNDERTOW_POLICY__RL_STEPS_PER_VERSION": str(opts.steps_per_version),
        "UNDERTOW_POLICY__RL_LR": str(opts.rl_lr),
        "UNDERTOW_POLICY__KL_COEF": str(opts.kl_coef),
        "UNDERTOW_POLICY__RL_MAX_EPOCHS": str(opts.max_epochs),
        "UNDERTOW_POLICY__THREADS": "1",
        "UNDERTOW_POLICY__SEED": str(opts.seed),
    }
    return {**env, **opts.env}


class Orchestrator:
    """Submits loop chains when there is new data and collects their outcomes."""

    def __init__(self, settings: Settings, stack: Any, opts: DemoOptions) -> None:
        from scheduler.loop.submit import producer

        self.settings = settings
        self.stack = stack
        self.opts = opts
        self.celery = producer(settings)
        self.inflight: str | None = None
        self.inflight_kind = ""
        self.inflight_since = 0.0
        self.groups_at_submit = 0
        self.outcomes: list[dict[str, Any]] = []
        self.drilled = False
        self.promoted = 0
        self.lend_checked_at = -math.inf
        self.no_lend_since: float | None = None
        self.longest_no_lend_s = 0.0
        self.fleet: FleetControl | None = None

    def expected_chain_s(self) -> float:
        """How long an update takes end to end (the slowest finished so far; a guess before any)."""
        done = [o["seconds"] for o in self.outcomes if "seconds" in o]
        return max(done) if done else self.opts.expected_update_s

    def planner_lends(self) -> bool:
        """Whether the capacity planner would let an update borrow a replica of some pool now, whoever
        holds one (the demo's only borrower is its own update)."""
        from scheduler.loop.borrowing import fleet_control
        from scheduler.loop.planning import plan_pools

        if self.fleet is None:  # made once: the registry's fleet opens a database engine
            self.fleet = fleet_control(self.settings)
        return any(plan["lendable"] > 0 for _ids, plan in plan_pools(self.fleet, self.settings))

    def observe_lending(self) -> None:
        """Every ``lend_check_s``: ask the planner whether it would lend, and track the stretches when it
        would not (at the trace's peak every replica serves)."""
        now = time.monotonic()
        if now - self.lend_checked_at < self.opts.lend_check_s:
            return
        self.lend_checked_at = now
        try:
            lends = self.planner_lends()
        except Exception as exc:  # the estimate is advisory: a failed check never stops the loop
            log.warning("demo.lend_check_failed", error=str(exc))
            lends = True
        if not lends and self.no_lend_since is None:
            self.no_lend_since = now
        elif lends and self.no_lend_since is not None:
            self.longest_no_lend_s = max(self.longest_no_lend_s, now - self.no_lend_since)
            self.no_lend_since = None

    def expected_wait_s(self) -> float:
        """How long an update submitted now would wait for a replica: none while the planner lends; else
        the longest stretch without a replica seen so far, the current one's age (a stretch N s old is
        taken to last about N s more) or one retry delay, whichever is longest."""
        if self.no_lend_since is None:
            return 0.0
        current = time.monotonic() - self.no_lend_since
        return max(self.longest_no_lend_s, current, self.settings.scheduler.preempt_resume_s)

    def groups(self) -> int:
        """Groups stored so far that an update trains on: candidate groups (the K choices of one request)
        and groups of parallel agent sessions on one task (``turn.group``, one row per turn)."""
        from sqlalchemy import func, select

        from ingest.tables import SessionRow

        group = func.coalesce(SessionRow.group_id, SessionRow.extra["turn"]["group"].as_string())
        with self.stack.engine.connect() as conn:
            return int(conn.scalar(select(func.count(func.distinct(group)))) or 0)

    def submit(self, kind: str) -> None:
        from scheduler.loop.state import LoopState, RLInputs
        from scheduler.loop.submit import submit

        # the drill is not meant to serve, and with eval_after every version is evaluated after the traffic
        # phase: either way the update skips its held-out evaluation (most of an update's time)
        in_update = kind != "drill" and not self.opts.eval_after
        no_eval = {"per_tier": 0, "agent_per_tier": 0}
        rl = RLInputs(groups_per_step=self.opts.groups_per_step, eval=eval_fields(self.opts) if in_update else no_eval)
        if kind == "drill":
            rl = rl.model_copy(update={"lr": self.opts.drill_lr, "label": DRILL_LABEL})
        run_id = f"{kind}-{uuid.uuid4().hex[:6]}"
        state = LoopState(run_id=run_id, kind="loop", evaluate=in_update, rl=rl, requested_by="demo")
        self.inflight = submit(self.stack.engine, self.settings, state, celery=self.celery)
        self.inflight_kind, self.inflight_since = kind, time.monotonic()
        self.groups_at_submit = self.groups()
        log.info("demo.chain_submitted", kind=kind, run_id=run_id)

    def poll(self, left_s: float) -> str:
        """Collect a finished job; submit the next one when there is enough new data and an update could
        finish in the ``left_s`` seconds left of the traffic phase. The estimate is taken after the
        collection, so an update that just finished slower than all before it counts, and so does the wait
        for a replica while the planner lends none (:meth:`expected_wait_s`): a wait longer than any
        finished update's could otherwise still run past the phase."""
        from sqlalchemy import select

        from scheduler.loop.jobs import FINISHED, reap_lost
        from scheduler.tables import JobRow

        if self.inflight is not None:
            reap_lost(self.stack.engine, self.settings.scheduler.job_lost_after_s)
            with self.stack.engine.connect() as conn:
                row = conn.execute(
                    select(JobRow.state, JobRow.outputs, JobRow.error).where(JobRow.id == self.inflight)
                ).one()
            if row.state not in FINISHED:
                return f"{self.inflight_kind} update running ({time.monotonic() - self.inflight_since:.0f} s)"
            outcome: dict[str, Any] = {"kind": self.inflight_kind, "seconds": time.monotonic() - self.inflight_since}
            if row.state == "SUCCESS":
                outcome["state"] = dict(row.outputs or {})
                if (outcome["state"].get("deployment") or {}).get("status") == "succeeded":
                    self.promoted += 1
            else:  # a failed job is reported, the demo goes on
                outcome["error"] = f"{row.state}: {row.error}"
            self.outcomes.append(outcome)
            self.inflight = None
        self.observe_lending()
        expected = self.expected_chain_s()
        if expected >= left_s:
            return "no new updates (end of the traffic phase)"
        new = self.groups() - self.groups_at_submit
        if new < self.opts.min_new_groups:
            return f"collecting data ({new}/{self.opts.min_new_groups} new groups)"
        wait = self.expected_wait_s()
        if expected + wait >= left_s:
            return f"no new updates (no replica can be lent now; a wait of about {wait:.0f} s would overrun)"
        kind = "drill" if self.opts.drill and self.promoted >= 1 and not self.drilled else "update"
        self.drilled = self.drilled or kind == "drill"
        self.submit(kind)
        return f"{kind} submitted"


def _progress_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="Undertow demo: the closed loop", show_header=False, expand=False)
    for key, value in status.items():
        table.add_row(key, str(value))
    return table


def run_demo(base: Settings, opts: DemoOptions) -> dict[str, Any]:
    """Run the demo; returns the report (see :func:`scheduler.demo.report.build_report`)."""
    from rich.console import Console
    from rich.live import Live

    from ingest.synthetic import default_trace_path, load_rates
    from policy.evaluate import EvalConfig
    from policy.model import load_checkpoint
    from scheduler.demo.developers import DeveloperConfig, Developers
    from scheduler.demo.heldout import evaluate_versions
    from scheduler.demo.population import PopulationConfig
    from scheduler.demo.report import build_report
    from scheduler.demo.stack import DemoStack, v0_cache
    from scheduler.runtime.logs import configure_logging
    from scheduler.settings import load_settings

    console = Console(stderr=True)
    started = time.monotonic()
    trace = default_trace_path()
    if trace is None:
        raise FileNotFoundError("no ServeGen trace found (shared data or the test slice); see tests/ingest/data")
    rates = load_rates(trace)
    span_s = opts.minutes * 60.0
    speedup = 86400.0 / span_s
    home = (base.home / "demo" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ.pop("UNDERTOW_DATABASE_URL", None)  # the demo runs on its own embedded SQLite file
    os.environ.update(_env(home, opts, speedup))
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_json)  # the demo's own level (progress shows the rest)
    logging.getLogger("kafka").setLevel(logging.ERROR)  # the client's event-loop timing warnings
    eval_cfg = EvalConfig(**eval_fields(opts))
    with console.status("policy v0: loading the cached warm-up (training it on the first run)"):
        v0_path, v0_metrics = v0_cache(
            settings,
            (base.home / "demo-cache").resolve(),
            sft_steps=opts.sft_steps,
            eval_cfg=eval_cfg,
            agent_every=opts.sft_agent_every,
            mixes=opts.sft_mixes,
        )
    agent_v0 = v0_metrics.get("eval/agent/success")
    agent_line = "" if agent_v0 is None else f", agent held-out task success {agent_v0:.3f}"
    console.print(f"v0 held-out keep rate {v0_metrics['eval/keep_rate']:.3f}{agent_line} ({v0_path.name})")
    stack = DemoStack(settings, v0_path, v0_metrics, replicas=opts.replicas)
    with console.status("starting broker, database, worker, engines, gateway and API"):
        stack.start()
    setup_s = time.monotonic() - started
    console.print(
        f"gateway {stack.gateway_url} (key: {stack.gateway_key})  "
        f"dashboards {stack.api_url}/  (operator token: {stack.api_token})"
    )
    _model, tokenizer = load_checkpoint(v0_path)
    devs = Developers(
        stack.gateway_url,
        tokenizer,
        rates,
        span_s,
        speedup,
        DeveloperConfig(
            mean_rps=opts.mean_rps,
            agent_share=opts.agent_share,
            agent_group=opts.agent_group,
            population=PopulationConfig() if opts.population else None,
        ),
        seed=opts.seed,
        api_key=stack.gateway_key,
        utility_log=home / "true_utility.jsonl" if opts.population else None,
    )
    import asyncio

    dev_thread = threading.Thread(target=lambda: asyncio.run(devs.run()), name="demo-developers", daemon=True)
    orch = Orchestrator(settings, stack, opts)
    traffic_start = time.monotonic()
    dev_thread.start()
    report: dict[str, Any] = {}
    try:
        with Live(console=console, refresh_per_second=2) as live:
            while True:
                now = time.monotonic() - traffic_start
                status = orch.poll(span_s - now)
                done = now >= span_s and orch.inflight is None
                if done or now >= span_s + opts.finish_grace_s:
                    break
                s = devs.stats
                live.update(
                    _progress_table(
                        {
                            "simulated time": f"{min(now, span_s) * speedup / 3600:5.1f} h of 24 h",
                            "requests": f"{s.requests} ({s.errors} errors), kept {s.kept}, passed {s.passed}",
                            "agent sessions": (
                                f"{s.agent_sessions} ({s.agent_errors} errors), submitted {s.agent_submitted}, "
                                f"kept {s.agent_kept}, {s.agent_summaries} with a summary"
                            ),
                            "by version": dict(s.by_version),
                            "signals sent": f"{s.signals} ({s.signal_errors} refused)",
                            "loop": status,
                            "updates": f"{len(orch.outcomes)} finished, {orch.promoted} promoted",
                            "serving": _target(stack.engine),
                        }
                    )
                )
                time.sleep(1.0)
        devs.halt()
        dev_thread.join(timeout=60)
        if orch.inflight is not None:  # past the grace period: report it as unfinished
            orch.outcomes.append({"kind": orch.inflight_kind, "error": "still running at the end of the demo"})
        eval_s = 0.0
        if opts.eval_after:
            eval_started = time.monotonic()
            with console.status(f"evaluating the versions on the held-out set ({opts.eval_workers} processes)"):
                evaluate_versions(
                    stack.engine,
                    eval_cfg,
                    first=_target(stack.engine),
                    workers=opts.eval_workers,
                    on_done=lambda vid, m: console.print(f"{vid}: held-out task success {_rate(m)}"),
                )
            eval_s = time.monotonic() - eval_started
        report = build_report(stack, orch.outcomes, devs.stats, v0_metrics, devs.population)
        report["minutes"] = round((time.monotonic() - started) / 60.0, 2)
        report["setup_minutes"] = round(setup_s / 60.0, 2)
        report["heldout_eval_minutes"] = round(eval_s / 60.0, 2)
        report["traffic_minutes"] = round(opts.minutes, 2)
        report["home"] = str(home)
        if opts.keep_running:
            _wait(console, stack)
    finally:
        devs.halt()
        stack.stop()
    return report


def _rate(metrics: dict[str, float]) -> str:
    value = metrics.get("eval/agent/success", metrics.get("eval/keep_rate"))
    return "-" if value is None else f"{100 * value:.1f}%"


def _target(engine: Any) -> str:
    from serving.fleet import get_target

    target = get_target(engine)
    return target.version if target else "-"


def _wait(console: Any, stack: Any) -> None:
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"stack up: gateway {stack.gateway_url}, dashboards {stack.api_url}/; Ctrl-C stops")
    stop.wait()
