"""Rolling a weights version out to a pool: canary, gated progressive stages, automatic rollback.

Per replica: pull the update while it still serves (``undertow_prefetch``; a delta from the
version it serves when the store has one, else the full snapshot), mark it ``updating``, pause
it (new requests are held, running ones finish), apply with the hash check, resume, record.
Pulls start for the whole pool when the rollout starts (``prefetch_ahead``, at most
``prefetch_concurrency`` at a time), so later stages pull while the canary is moved and judged
and a stage waits only for pulls not finished yet; replicas a failed rollout never moved drop
what they staged.
The canary stage updates ``canary_replicas``; each following stage brings the fleet up to a
fraction in ``stages``. After every stage the gate compares the new version's online metrics
(error rate, p50 latency, share of answers cut at the token limit, answer length, acceptance proxy) with the current
version's, once the new version has served ``gate_min_requests`` and users judged
``gate_min_judged`` of its sessions; a failed
gate, or an update that fails, rolls every updated replica back (by the cheapest path: the reverse
delta when the store has it, else the old snapshot) and leaves the pool's target where it was.

The reward-hacking guard (``guard``, :func:`reward_models.api.promotion_check` in the scheduler)
is one more gate: after a stage's online gate passes, and when an operator promotes a running
rollout, the new version's sessions are compared with the old version's (reward-model score up
while real retention down); a flagged version fails that stage and is rolled back like any failed
gate, with the guard's reason in the stage and the deployment's message. A guard that has too
little data to judge does not block; the message says so. An operator's forced promote
(``force_promote``) skips the guard.

Left out: traffic-share canaries (weighted routing to a canary); the canary here is whole
replicas, which the balancer already shares traffic with.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.engine import Engine

from ingest.db import transaction
from reward_models.guard import HackingReport
from serving import fleet
from serving.client import EngineClient, EngineError
from serving.config import DeployConfig, FleetConfig
from serving.protocol import PrefetchRequest
from serving.tables import DeploymentRow, DeploymentStageRow

log = structlog.get_logger(__name__)

MetricsSource = Callable[[], Awaitable[dict[str, Any]]]
"""Returns ``{"versions": {version: {requests, errors, error_rate, latency_ms_p50, latency_ms_p50_since,
acceptance, ...}}}`` (:meth:`serving.gateway.Gateway.metrics`)."""

GuardCheck = Callable[[str, str], HackingReport]
"""``(new version, old version)`` -> the reward-hacking guard's verdict on promoting the new one."""

PROMOTED_BY_OPERATOR = "promoted by an operator"
FORCED_BY_OPERATOR = "promoted by an operator (reward-hacking guard overridden)"


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class RolloutResult:
    """What a rollout did (also recorded in ``serving_deployments``)."""

    deployment_id: int
    status: str
    message: str
    seconds: float
    pause_ms: dict[str, float] = field(default_factory=dict)
    pulled_bytes: dict[str, int] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=list)
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Seconds per step: per replica (``prefetch``, ``registry``, ``drain``, ``apply``, ``resume``, and the
    engine's own ``engine_prefetch``/``engine_apply`` phases), and for the rollout as a whole (``rollout``:
    ``setup``, ``gate``, ``finish``)."""


def _judged_enough(new: dict[str, Any], config: DeployConfig) -> bool:
    """Whether the new version has its minimum of judged sessions (always, when the metrics source
    does not count them)."""
    if new.get("judged") is None and new.get("judged_sessions") is None:
        return True
    return _n(new) >= config.gate_min_judged


def gate(new: dict[str, Any] | None, old: dict[str, Any] | None, config: DeployConfig) -> tuple[bool, str]:
    """Judge a stage: the new version's online metrics against the current version's.

    Fails when the new version served fewer than ``gate_min_requests``, or was judged on fewer than
    ``gate_min_judged`` sessions (when the source counts them; :func:`health` fails it before that:
    error rate, latency, answers cut at the token limit), or its acceptance proxy dropped by more than
    ``gate_max_acceptance_drop`` and by at least ``gate_acceptance_z`` standard errors of the
    difference (compared only when both versions have judged sessions; without their counts,
    ``judged``, the drop alone decides), and, where both were judged on the same kinds of traffic,
    also within those kinds (:func:`stratified_drop`).
    """
    if not new or new.get("requests", 0) < config.gate_min_requests:
        served = 0 if not new else new.get("requests", 0)
        return (
            False,
            f"the new version served {served} requests, fewer than the minimum sample of {config.gate_min_requests}",
        )
    old = old or {}
    unhealthy = health(new, old, config)
    if unhealthy is not None:
        return False, unhealthy
    if not _judged_enough(new, config):
        return (
            False,
            f"the new version was judged on {_n(new)} sessions, fewer than the minimum of "
            f"{config.gate_min_judged}: nobody could judge it yet",
        )
    if new.get("acceptance") is not None and old.get("acceptance") is not None:
        drop = old["acceptance"] - new["acceptance"]
        se = _drop_se(new, old)
        if drop > config.gate_max_acceptance_drop and drop >= config.gate_acceptance_z * se:
            shown = f", {drop / se:.1f} standard errors" if se > 0 else ""
            within = stratified_drop(new, old)
            if within is None:
                return False, f"acceptance dropped by {drop:.3f}{shown} (limit {config.gate_max_acceptance_drop})"
            kind_drop, kind_se = within
            if kind_drop > config.gate_max_acceptance_drop and kind_drop >= config.gate_acceptance_z * kind_se:
                return False, (
                    f"acceptance dropped by {drop:.3f}{shown}, and by {kind_drop:.3f} within each kind of traffic "
                    f"(limit {config.gate_max_acceptance_drop})"
                )
    return True, "passed"


def health(new: dict[str, Any], old: dict[str, Any], config: DeployConfig, *, final: bool = True) -> str | None:
    """Why the new version is unhealthy by what every request shows, no user's judgement needed (error
    rate, p50 latency, answers cut at the token limit, answers with a malformed tool call, answers a
    fraction or a multiple of the usual length: :func:`length_shift`), or None. A
    rise of the error rate, the cut answers or the malformed calls counts when it is over its limit and,
    where the source counts requests and answers, significant (Fisher's exact test,
    :func:`rise_p_value`): one failed request among a canary's first sixteen is not a broken version.

    ``final``: the stage's decision, tested at the gate's level (``gate_acceptance_z``, one-sided);
    otherwise one of the many looks taken while a stage waits for its users' signals, which fails it
    only on overwhelming evidence (``gate_interim_alpha``): a Haybittle-Peto boundary, so that looking
    after every answer does not multiply the false alarms of a single test."""
    alpha = rise_alpha(config, final=final)
    errors = _rate_rise(new, old, "error_rate", "requests")
    if errors is None:  # a source that does not count requests: the rise alone
        errors = (new.get("error_rate", 0.0) - old.get("error_rate", 0.0), 0.0)
    rise, p_value = errors
    if rise > config.gate_max_error_rate_delta and (alpha is None or p_value <= alpha):
        return f"error rate rose by {rise:.3f} (limit {config.gate_max_error_rate_delta})"
    if old.get("latency_ms_p50") and new.get("latency_ms_p50"):
        ratio = new["latency_ms_p50"] / old["latency_ms_p50"]
        if ratio > config.gate_max_latency_ratio:
            when = " over the same stretch of time" if "latency_ms_p50_all" in old else ""
            return f"p50 latency is {ratio:.2f}x the current version's{when} (limit {config.gate_max_latency_ratio}x)"
    for rate, limit, what in (
        ("truncation_rate", config.gate_max_truncation_rise, "answers cut at the token limit"),
        ("malformed_tool_call_rate", config.gate_max_malformed_tool_rise, "answers with a malformed tool call"),
    ):
        found = _rate_rise(new, old, rate, "answers")
        if found is not None:
            rise, p_value = found
            if rise > limit and (alpha is None or p_value <= alpha):
                return f"{what} rose from {old[rate]:.3f} to {new[rate]:.3f} (limit +{limit})"
    shift = length_shift(new, old)
    if shift is not None:
        ratio, p_value = shift
        limit = config.gate_max_length_ratio
        if (ratio > limit or ratio < 1.0 / limit) and (alpha is None or p_value <= alpha):
            return (
                f"answers are {ratio:.2f}x the current version's length in tokens "
                f"({new['answer_tokens_mean']:.1f} against {old['answer_tokens_mean']:.1f}; "
                f"limit {1.0 / limit:.2f}x to {limit:.2f}x)"
            )
    return None


MIN_PAIRED_LATENCIES = 8
"""Requests the current version must have served since the new version's first one before the gate
compares the two versions' latencies over that stretch of time alone (:func:`same_window`)."""


def same_window(old: dict[str, Any] | None, new_v: str) -> dict[str, Any] | None:
    """The current version's metrics with its p50 latency taken over the new version's stretch of time
    (``latency_ms_p50_since``, :func:`serving.gateway.paired_latency`) where it served at least
    :data:`MIN_PAIRED_LATENCIES` requests in it; its p50 over everything it retains stays as
    ``latency_ms_p50_all``. A canary served while an update trains beside the engines is then compared
    with what the current version's users saw under the same load, not with its calm hours: a 2-core
    demo machine rolled back a healthy canary at 3.13x the current version's all-time p50."""
    if not old:
        return old
    paired = (old.get("latency_ms_p50_since") or {}).get(new_v)
    if not paired or int(paired.get("n") or 0) < MIN_PAIRED_LATENCIES:
        return old
    return {**old, "latency_ms_p50": paired["p50"], "latency_ms_p50_all": old.get("latency_ms_p50")}


def length_shift(new: dict[str, Any], old: dict[str, Any]) -> tuple[float, float] | None:
    """The ratio of the new version's mean answer length in tokens to the old one's and the two-sided
    p-value of the difference (Welch's t-test on the means, standard deviations and counts), or None
    when either side counted fewer than two answers (or the source does not count them)."""
    from scipy.stats import ttest_ind_from_stats

    n_new, n_old = int(new.get("answer_tokens_n") or 0), int(old.get("answer_tokens_n") or 0)
    if n_new < 2 or n_old < 2 or new.get("answer_tokens_mean") is None or old.get("answer_tokens_mean") is None:
        return None
    m_new, m_old = float(new["answer_tokens_mean"]), float(old["answer_tokens_mean"])
    sd_new, sd_old = float(new.get("answer_tokens_sd") or 0.0), float(old.get("answer_tokens_sd") or 0.0)
    if m_old <= 0:
        return None
    if sd_new == 0 and sd_old == 0:  # no spread at all: any difference is certain
        return m_new / m_old, 0.0 if m_new != m_old else 1.0
    test = ttest_ind_from_stats(m_new, sd_new, n_new, m_old, sd_old, n_old, equal_var=False)
    return m_new / m_old, float(test.pvalue)


def stratified_drop(new: dict[str, Any], old: dict[str, Any]) -> tuple[float, float] | None:
    """The acceptance drop compared within each kind of traffic (``by_kind``: agent sessions, single
    requests) and its standard error, or None without a kind both versions have signals on.

    Agent sessions are accepted far less often than single completions, and a canary that happened
    to serve more of them would look worse by its mix alone. So the drops of the kinds both versions
    were judged on are averaged with weights by the kind's judged sessions on both sides (a
    stratified difference), their variances (pooled, :func:`_null_variance`) with the squared
    weights. The gate fails a stage on acceptance only when the overall drop and this one are both
    too large."""
    kinds_new, kinds_old = new.get("by_kind") or {}, old.get("by_kind") or {}
    common = sorted(k for k in kinds_new if k in kinds_old and _n(kinds_new[k]) and _n(kinds_old[k]))
    if not common:
        return None
    total = sum(_n(kinds_new[k]) + _n(kinds_old[k]) for k in common)
    drop = variance = 0.0
    for k in common:
        a, b = kinds_new[k], kinds_old[k]
        w = (_n(a) + _n(b)) / total
        p_new, p_old = _unit(a["acceptance"]), _unit(b["acceptance"])
        drop += w * (p_old - p_new)
        variance += w * w * _null_variance(p_new, _n(a), p_old, _n(b))
    return drop, math.sqrt(variance)


def _unit(rate: Any) -> float:
    """A rate from a metrics source, clamped to [0, 1]."""
    return min(max(float(rate), 0.0), 1.0)


def _null_variance(p_new: float, n_new: int, p_old: float, n_old: int) -> float:
    """Variance of ``p_old - p_new`` if both versions were accepted alike (the pooled two-proportion
    test): unlike each side's own ``p (1 - p) / n``, a canary that no one accepted yet (``p_new`` 0)
    on a handful of sessions does not look certain."""
    pooled = (p_new * n_new + p_old * n_old) / (n_new + n_old)
    return pooled * (1 - pooled) * (1 / n_new + 1 / n_old)


def rise_alpha(config: DeployConfig, *, final: bool) -> float | None:
    """The one-sided p-value at or under which a rise counts: the gate's own level
    (``gate_acceptance_z``) for a stage's decision, ``gate_interim_alpha`` for the looks before it;
    None when ``gate_acceptance_z`` is 0 (the rise alone decides)."""
    if config.gate_acceptance_z <= 0:
        return None
    level = 1.0 - statistics.NormalDist().cdf(config.gate_acceptance_z)
    return level if final else min(level, config.gate_interim_alpha)


def rise_p_value(k_new: int, n_new: int, k_old: int, n_old: int) -> float:
    """One-sided p-value that the new version's rate (``k_new`` of ``n_new``) is no higher than the old
    one's (``k_old`` of ``n_old``): Fisher's exact test. Cut answers are rare and a canary's sample is
    small, where the normal approximation of a two-proportion test calls three of sixteen against a
    3% baseline a 3.4-sigma event (it is a 1-in-65 one)."""
    from scipy.stats import fisher_exact

    table = [[k_new, n_new - k_new], [k_old, n_old - k_old]]
    return float(fisher_exact(table, alternative="greater").pvalue)


def _rate_rise(new: dict[str, Any], old: dict[str, Any], rate: str, count: str) -> tuple[float, float] | None:
    """The rise of a per-request rate (errors per request, answers cut at the token limit per answer)
    and its one-sided exact p-value (:func:`rise_p_value` on the counts), or None when either side has
    not counted any yet (or the source does not count them)."""
    n_new, n_old = int(new.get(count) or 0), int(old.get(count) or 0)
    if n_new <= 0 or n_old <= 0 or new.get(rate) is None or old.get(rate) is None:
        return None
    p_new, p_old = _unit(new[rate]), _unit(old[rate])
    k_new, k_old = round(p_new * n_new), round(p_old * n_old)
    return p_new - p_old, rise_p_value(k_new, n_new, k_old, n_old)


def _n(side: dict[str, Any]) -> int:
    """The sample size of one side's acceptance: its judged sessions when the source counts them (one
    session's signals, an accept and its retention at each horizon, are one observation), else its
    judged signals."""
    sessions = side.get("judged_sessions")
    return int(sessions if sessions is not None else side.get("judged") or 0)


def _drop_se(new: dict[str, Any], old: dict[str, Any]) -> float:
    """Standard error of ``old - new`` acceptance from the judged sessions (:func:`_n`; 0 when a count is missing)."""
    n_new, n_old = _n(new), _n(old)
    if n_new <= 0 or n_old <= 0:
        return 0.0
    p_new, p_old = _unit(new["acceptance"]), _unit(old["acceptance"])
    return math.sqrt(_null_variance(p_new, n_new, p_old, n_old))


def stage_sizes(n: int, config: DeployConfig) -> list[int]:
    """Cumulative replica counts after each stage: the canary, then each fraction of the fleet."""
    sizes = [min(n, config.canary_replicas)]
    for fraction in config.stages:
        size = min(n, max(sizes[-1], math.ceil(fraction * n)))
        if size > sizes[-1]:
            sizes.append(size)
    if sizes[-1] < n:
        sizes.append(n)
    return sizes


def _beat(db: Engine, dep_id: int) -> str | None:
    """Record that the deployer is alive (see :func:`serving.fleet.recover_stale`); returns what an
    operator asked of this deployment meanwhile (``promote``/``rollback``, :mod:`serving.actions`)."""
    with transaction(db) as s:
        row = s.get(DeploymentRow, dep_id)
        if row is None:
            return None
        row.heartbeat_at = _now()
        return row.requested


async def _wait_gate(
    metrics: MetricsSource | None,
    new_v: str,
    old_v: str,
    config: DeployConfig,
    beat: Callable[[], str | None],
) -> tuple[bool, str, dict[str, Any]]:
    """Judge a stage once the new version has its minimum sample, or when an operator decides first."""
    deadline = time.monotonic() + config.gate_max_wait_s
    while True:
        asked = beat()
        if asked == "promote":
            return True, PROMOTED_BY_OPERATOR, {}
        if asked == "force_promote":
            return True, FORCED_BY_OPERATOR, {}
        if asked == "rollback":
            return False, "rolled back by an operator", {}
        if metrics is None:
            return True, "passed", {}
        snap = (await metrics()).get("versions", {})
        new, old = snap.get(new_v), same_window(snap.get(old_v), new_v)
        served = bool(new) and new.get("requests", 0) >= config.gate_min_requests
        unhealthy = health(new, old or {}, config, final=False) if served else None
        if unhealthy is not None:  # fails now, before users judged it (on overwhelming evidence only)
            return False, unhealthy, {"new": new, "old": old}
        if (served and _judged_enough(new, config)) or time.monotonic() > deadline:
            ok, why = gate(new, old, config)
            return ok, why, {"new": new, "old": old}
        await asyncio.sleep(0.05)


async def _move(
    db: Engine,
    rep: fleet.Replica,
    version: str,
    weights_hash: str,
    kind: str,
    config: DeployConfig,
    pulled: dict[str, Any] | None = None,
    client: EngineClient | None = None,
    timings: dict[str, Any] | None = None,
    token: SecretStr | None = None,
) -> tuple[int, float]:
    """Update one replica (``pulled``: already prefetched; ``token``: the control token of a client made
    here); returns (bytes pulled, pause ms).

    ``timings`` receives the seconds of each step (see :func:`serving.fleet.update_replica`) and
    of the registry writes (``registry``)."""
    times = timings if timings is not None else {}
    start = time.perf_counter()
    fleet.set_state(db, rep.id, "updating")
    times["registry"] = time.perf_counter() - start
    recorded = False
    try:
        async with contextlib.AsyncExitStack() as stack:
            if client is None:
                client = await stack.enter_async_context(EngineClient(rep.url, token=token))
            pulled, pause_ms = await fleet.update_replica(
                client,
                version,
                weights_hash,
                from_version=None,
                kind=kind,
                pause_timeout_s=config.pause_timeout_s,
                pulled=pulled,
                timings=times,
            )
        start = time.perf_counter()
        fleet.record_weights(db, rep.id, version, weights_hash, state="serving")
        recorded = True
        times["registry"] += time.perf_counter() - start
        return int(pulled.get("bytes", 0)), pause_ms  # type: ignore[call-overload]
    finally:
        if not recorded:
            fleet.set_state(db, rep.id, "serving")


async def rollout(
    db: Engine,
    to_version: str,
    to_hash: str,
    config: DeployConfig,
    *,
    pool: str = "default",
    kind: str = "auto",
    metrics: MetricsSource | None = None,
    fleet_config: FleetConfig | None = None,
    guard: GuardCheck | None = None,
) -> RolloutResult:
    """Roll ``to_version`` out over ``pool`` (see module docstring); never raises for a failed stage.

    ``guard``: the reward-hacking guard judged after every passed stage (None: no guard)."""
    start = time.perf_counter()
    overall: dict[str, float] = {"setup": 0.0, "gate": 0.0, "finish": 0.0}
    fleet_config = fleet_config or FleetConfig()
    token = fleet_config.control_token
    if fleet.recover_stale(db, config.stale_after_s, pool):
        # A crashed deployer left replicas on its version: bring them back to the target first.
        await fleet.check_fleet(db, fleet_config, pool)
        await fleet.reconcile(db, fleet_config, pool, config.pause_timeout_s)
        await fleet.check_fleet(db, fleet_config, pool)
    with transaction(db) as s:
        busy = s.scalars(
            select(DeploymentRow).where(DeploymentRow.pool == pool, DeploymentRow.status == "running")
        ).first()
        if busy is not None:
            raise ValueError(
                f"deployment {busy.id} ({busy.from_version} -> {busy.to_version}) is still running on pool {pool!r}; "
                f"wait for it (it is failed automatically {config.stale_after_s:.0f}s after its deployer stops)"
            )
    target = fleet.get_target(db, pool)
    if target is None:
        raise ValueError(f"pool {pool!r} has no target version; set one with `undertow fleet target VERSION HASH`")
    old_version, old_hash = target.version, target.weights_hash
    replicas = [r for r in fleet.list_replicas(db, pool) if r.in_rotation]
    if not replicas:
        raise ValueError(f"pool {pool!r} has no replica in rotation to deploy to")
    with transaction(db) as s:
        row = DeploymentRow(
            pool=pool,
            from_version=old_version,
            to_version=to_version,
            to_hash=to_hash,
            from_hash=old_hash,
            kind=kind,
            status="running",
            message="",
            started_at=_now(),
            heartbeat_at=_now(),
        )
        s.add(row)
        s.flush()
        dep_id = row.id
    result = RolloutResult(dep_id, "running", "", 0.0)
    result.phases["rollout"] = overall
    overall["setup"] = time.perf_counter() - start
    updated: list[fleet.Replica] = []
    done = 0
    failure = ""
    guard_note = ""
    async with contextlib.AsyncExitStack() as stack:
        clients = {r.id: await stack.enter_async_context(EngineClient(r.url, token=token)) for r in replicas}
        pulls = _Pulls(to_version, kind, config.prefetch_concurrency, clients, result)
        if config.prefetch_ahead:
            pulls.start(replicas)
        try:
            for idx, size in enumerate(stage_sizes(len(replicas), config)):
                batch = replicas[done:size]
                name = "canary" if idx == 0 else f"stage-{idx}"
                stage = {"name": name, "replicas": [r.id for r in batch], "outcome": "running", "started_at": _now()}
                # Every replica of the stage has pulled before any of them pauses.
                pulls.start(batch)
                _beat(db, dep_id)
                current = "prefetch"
                try:
                    pulled = {r.id: await pulls.wait(r) for r in batch}
                    for rep in batch:
                        current = rep.id
                        nbytes, pause_ms = await _move(
                            db,
                            rep,
                            to_version,
                            to_hash,
                            kind,
                            config,
                            pulled[rep.id],
                            client=clients[rep.id],
                            timings=result.phases[rep.id],
                        )
                        updated.append(rep)
                        _beat(db, dep_id)
                        result.pause_ms[rep.id], result.pulled_bytes[rep.id] = pause_ms, nbytes
                except EngineError as exc:
                    stage["outcome"], failure = "error", f"{name}: update of {current} failed: {exc.message}"
                if not failure:
                    begin = time.perf_counter()
                    ok, why, observed = await _wait_gate(
                        metrics,
                        to_version,
                        old_version,
                        config,
                        lambda: _beat(db, dep_id),
                    )
                    overall["gate"] += time.perf_counter() - begin
                    stage["metrics"] = observed
                    if why in (PROMOTED_BY_OPERATOR, FORCED_BY_OPERATOR):
                        metrics = None  # the remaining stages move without gates
                    if why == FORCED_BY_OPERATOR:
                        guard, guard_note = None, "reward-hacking guard overridden by an operator"
                    if not ok:
                        stage["outcome"], failure = "failed", f"{name}: gate failed: {why}"
                    elif guard is not None:
                        try:
                            report = await asyncio.to_thread(guard, to_version, old_version)
                        except Exception as exc:  # a broken reward model must not stop every deploy: say so
                            log.warning("deploy.guard_error", deployment=dep_id, error=str(exc))
                            why = f"could not run ({type(exc).__name__}: {exc}), not blocking"
                            report = HackingReport(False, why)
                        stage["metrics"] = {**observed, "guard": {"flagged": report.flagged, "reason": report.reason}}
                        guard_note = f"reward-hacking guard: {report.reason}"
                        if report.flagged:
                            stage["outcome"] = "failed"
                            failure = f"{name}: promotion refused by the reward-hacking guard: {report.reason}"
                if not failure:
                    stage["outcome"] = "passed"
                stage["finished_at"] = _now()
                result.stages.append(stage)
                done = size
                if failure:
                    break
        finally:
            # Replicas that pulled ahead but were not moved drop what they staged.
            await pulls.abandon({r.id for r in updated})
    if failure:
        log.warning("deploy.rollback", deployment=dep_id, reason=failure)
        for rep in updated:
            try:
                await _move(db, rep, old_version, old_hash, "auto", config, token=token)
            except EngineError as exc:
                failure += f"; rollback of {rep.id} failed ({exc.message}), it leaves rotation until reconciled"
        result.status, result.message = "rolled_back", failure
    else:
        begin = time.perf_counter()
        fleet.set_target(db, to_version, to_hash, pool)
        overall["finish"] += time.perf_counter() - begin
        result.status, result.message = "succeeded", f"{len(replicas)} replicas on {to_version}"
        if guard_note:
            result.message += f" ({guard_note})"
    begin = time.perf_counter()
    _record(db, dep_id, result)
    overall["finish"] += time.perf_counter() - begin
    result.seconds = time.perf_counter() - start
    log.info("deploy.finished", deployment=dep_id, status=result.status, seconds=round(result.seconds, 3))
    return result


class _Pulls:
    """The rollout's pulls: one task per replica, at most ``limit`` at a time, started ahead of its stage."""

    def __init__(
        self, version: str, kind: str, limit: int, clients: dict[str, EngineClient], result: RolloutResult
    ) -> None:
        self.version, self.kind, self.clients, self.result = version, kind, clients, result
        self.slots = asyncio.Semaphore(limit)
        self.tasks: dict[str, asyncio.Task[dict[str, Any]]] = {}

    def start(self, replicas: list[fleet.Replica]) -> None:
        """Start pulling to each replica not pulling yet (serving continues on all of them)."""
        for rep in replicas:
            if rep.id not in self.tasks:
                self.tasks[rep.id] = asyncio.create_task(self._pull(rep))

    async def _pull(self, rep: fleet.Replica) -> dict[str, Any]:
        async with self.slots:
            begin = time.perf_counter()
            request = PrefetchRequest(to_version=self.version, from_version=rep.version, kind=self.kind)  # type: ignore[arg-type]
            pulled = await self.clients[rep.id].prefetch(request)
            self.result.phases[rep.id] = {
                "prefetch": time.perf_counter() - begin,
                "engine_prefetch": pulled.get("timings"),
            }
            return pulled

    async def wait(self, rep: fleet.Replica) -> dict[str, Any]:
        """What ``rep`` pulled (raises its pull's :class:`EngineError`)."""
        return await self.tasks[rep.id]

    async def abandon(self, moved: set[str]) -> None:
        """Stop pulls still running and make replicas that were not moved discard what they staged."""
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for rep_id, task in self.tasks.items():
            if rep_id in moved or task.cancelled() or task.exception() is not None:
                continue
            try:
                await self.clients[rep_id].discard()
            except EngineError as exc:  # it keeps serving its version; its next prefetch replaces what it staged
                log.warning("deploy.discard_failed", replica=rep_id, error=exc.message)


def _record(db: Engine, dep_id: int, result: RolloutResult) -> None:
    with transaction(db) as s:
        row = s.get(DeploymentRow, dep_id)
        assert row is not None
        # A promotion refused while the rollout ran (:mod:`serving.actions`) keeps its note after the outcome.
        note = row.message
        row.status, row.finished_at = result.status, _now()
        row.message = f"{result.message}; {note}" if note else result.message
        for i, st in enumerate(result.stages):
            s.add(
                DeploymentStageRow(
                    deployment_id=dep_id,
                    idx=i,
                    name=st["name"],
                    replicas=st["replicas"],
                    outcome=st["outcome"],
                    metrics=_jsonable(st.get("metrics") or {}),
                    started_at=st["started_at"],
                    finished_at=st.get("finished_at"),
                )
            )


def _jsonable(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, default=str))
