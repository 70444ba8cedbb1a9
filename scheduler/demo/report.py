"""The demo's final report: one row per policy version and the headline numbers.

Per version: held-out retention (pass-and-keep rate on the fixed held-out task set, which no
update trains on), held-out acceptance (pass rate there: developers accept code that passes),
online requests and acceptance proxy as the gateway measured them, the reward model promoted when
the version was trained and its primary metric, and the rollout outcome (succeeded, rolled back
with the gate's reason, or not deployed), and the agent's held-out task success
(``heldout_task_success``: multi-turn sessions with tools on held-out tasks, submitted code kept;
:mod:`policy.agent_eval`). With the population of users (:mod:`scheduler.demo.population`), each
version's ``heldout_true_utility`` is the population's mean true utility of its held-out outcomes
(what the users would get, never sent over the wire) and ``online_true_utility`` that of what the
users took from it while it served. The final version is the one the fleet serves at the end;
``gain_points`` is its held-out true utility minus v0's, in percentage points (``gain_measured_on``
says which: the agent's held-out task success without the population, held-out retention without
the agent), and ``true_utility_gain_points``, ``task_success_gain_points`` and
``retention_gain_points`` give each measure on its own. ``mean_turns`` and
``sessions_with_summary`` describe the agent sessions the developers ran through the gateway
(turns as telemetry stores them: policy turns and summaries).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _deployments(engine: Any) -> dict[str, dict[str, Any]]:
    from sqlalchemy import select

    from ingest.db import transaction
    from serving.tables import DeploymentRow

    out: dict[str, dict[str, Any]] = {}
    with transaction(engine) as s:
        for row in s.scalars(select(DeploymentRow).order_by(DeploymentRow.id)):
            out[row.to_version] = {
                "status": row.status,
                "message": row.message,
                "stages": [{"name": st.name, "outcome": st.outcome} for st in row.stages],
            }
    return out


def _borrowed(engine: Any) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from ingest.db import transaction
    from scheduler.tables import BorrowEventRow

    with transaction(engine) as s:
        rows = s.scalars(select(BorrowEventRow).where(BorrowEventRow.event.in_(["lent", "returned", "preempted"])))
        return [{"replica": r.replica_id, "event": r.event, "at": r.at.isoformat()} for r in rows]


def heldout_true_utility(population: Any, metrics: dict[str, Any]) -> float | None:
    """The population's mean true utility of a version's held-out outcomes: the agent's sessions when
    the agent was evaluated (kept, passed, submitted rates), else single completions (kept, passed)."""
    if population is None:
        return None
    if metrics.get("eval/agent/success") is not None:
        kept = float(metrics["eval/agent/success"])
        passed = max(kept, float(metrics.get("eval/agent/pass", kept)))
        submitted = max(passed, float(metrics.get("eval/agent/submitted", 1.0)))
        return float(population.expected_utility(kept, passed, submitted))
    if metrics.get("eval/keep_rate") is not None:
        kept = float(metrics["eval/keep_rate"])
        return float(population.expected_utility(kept, max(kept, float(metrics.get("eval/pass_rate", kept)))))
    return None


def build_report(
    stack: Any,
    outcomes: list[dict[str, Any]],
    dev_stats: Any,
    v0_metrics: dict[str, Any],
    population: Any = None,
) -> dict[str, Any]:
    """The JSON report (``versions``, ``v0_heldout_retention``, ``final_heldout_retention``,
    ``gain_points``, ``rollbacks``, and the loop's details)."""
    from policy.versions import list_versions
    from reward_models.registry import list_versions as reward_versions
    from serving.fleet import get_target

    engine = stack.engine
    online = stack.gateway.metrics().get("versions", {}) if stack.gateway is not None else {}
    deployments = _deployments(engine)
    by_version = {o["state"]["rl_update"]["version"]: o for o in outcomes if (o.get("state") or {}).get("rl_update")}
    versions = []
    for row in list_versions(engine):
        m = row.metrics or {}
        outcome = by_version.get(row.version_id, {})
        rm = outcome.get("state", {}).get("reward_model") or {}
        dep = deployments.get(row.version_id)
        live = online.get(row.version_id, {})
        versions.append(
            {
                "version": row.version_id,
                "parent": row.parent_id,
                "label": m.get("label") or ("warm-up" if row.parent_id is None else "update"),
                "heldout_retention": m.get("eval/keep_rate"),
                "heldout_acceptance": m.get("eval/pass_rate"),
                "heldout_task_success": m.get("eval/agent/success"),
                "heldout_agent_submitted": m.get("eval/agent/submitted"),
                "heldout_agent_turns": m.get("eval/agent/mean_requests"),
                "heldout_true_utility": heldout_true_utility(population, m),
                "online_true_utility": _online_utility(dev_stats, row.version_id),
                "online_requests": live.get("requests", 0),
                "online_acceptance": live.get("acceptance"),
                "train_reward_mean": m.get("reward/mean"),
                "rollouts": row.num_samples,
                # the promoted model whose scores this update trained on, and how many sessions it scored
                "reward_model": m.get("reward/model"),
                "reward_model_scored": m.get("batch/model_scored"),
                "trained_sessions": m.get("batch/sessions"),
                # what this update's retrain registered (a candidate the gate refused scored nothing)
                "reward_model_retrained": rm.get("retrained"),
                "reward_model_trained": rm.get("version") if rm.get("retrained") else None,
                "reward_model_trained_status": rm.get("status") if rm.get("retrained") else None,
                "reward_model_metric": rm.get("primary_metric") if rm.get("retrained") else None,
                "rollout": "initial" if row.parent_id is None else (dep["status"] if dep else "not deployed"),
                "rollout_message": dep["message"] if dep else "",
                "update_seconds": round(outcome["seconds"], 1) if "seconds" in outcome else None,
            }
        )
    target = get_target(engine)
    final = next((v for v in versions if target and v["version"] == target.version), versions[0] if versions else {})
    v0 = float(v0_metrics.get("eval/keep_rate", 0.0))
    final_rate = float(final.get("heldout_retention") or 0.0)
    v0_task = v0_metrics.get("eval/agent/success")
    final_task = final.get("heldout_task_success")
    retention_gain = round(100.0 * (final_rate - v0), 2)
    task_gain = None if v0_task is None else round(100.0 * (float(final_task or 0.0) - v0_task), 2)
    v0_utility = heldout_true_utility(population, v0_metrics)
    final_utility = final.get("heldout_true_utility")
    utility_gain = None
    if v0_utility is not None and final_utility is not None:
        utility_gain = round(100.0 * (final_utility - v0_utility), 2)
    gain, measured_on = retention_gain, "retention"
    if utility_gain is not None:
        gain, measured_on = utility_gain, "heldout_true_utility"
    elif task_gain is not None:
        gain, measured_on = task_gain, "heldout_task_success"
    agent_sessions = dev_stats.agent_sessions
    return {
        "versions": versions,
        "v0_heldout_retention": v0,
        "final_version": final.get("version"),
        "final_heldout_retention": final_rate,
        "v0_heldout_task_success": v0_task,
        "final_heldout_task_success": final_task,
        "v0_heldout_true_utility": v0_utility,
        "final_heldout_true_utility": final_utility,
        "gain_points": gain,
        "gain_measured_on": measured_on,
        "true_utility_gain_points": utility_gain,
        "task_success_gain_points": task_gain,
        "retention_gain_points": retention_gain,
        "mean_turns": round(dev_stats.agent_turns / agent_sessions, 2) if agent_sessions else None,
        "sessions_with_summary": dev_stats.agent_summaries,
        "rollbacks": sum(1 for d in deployments.values() if d["status"] == "rolled_back"),
        "deployments": deployments,
        "reward_models": [
            {k: (str(v) if k.endswith("_at") or k.startswith("window") else v) for k, v in r.items()}
            for r in reward_versions(engine)
        ],
        "borrowing": _borrowed(engine),
        "failed_updates": [o["error"] for o in outcomes if "error" in o],
        "developers": {
            "requests": dev_stats.requests,
            "errors": dev_stats.errors,
            "signals": dev_stats.signals,
            "signals_refused": dev_stats.signal_errors,
            "kept": dev_stats.kept,
            "passed": dev_stats.passed,
            "by_version": dict(dev_stats.by_version),
            "agent_sessions": agent_sessions,
            "agent_errors": dev_stats.agent_errors,
            "agent_submitted": dev_stats.agent_submitted,
            "agent_kept": dev_stats.agent_kept,
            "population": population is not None,
            "signals_late": dev_stats.signals_late,
            "churned_users": dev_stats.churned,
            "online_true_utility": _mean_utility(dev_stats) if population is not None else None,
        },
    }


def _mean_utility(dev_stats: Any) -> float:
    """Mean true utility of every request the users judged (population only)."""
    return round(sum(dev_stats.utility_by_version.values()) / max(1, sum(dev_stats.judged_by_version.values())), 4)


def _online_utility(dev_stats: Any, version: str) -> float | None:
    """Mean true utility of the requests a version served (population only)."""
    n = dev_stats.judged_by_version.get(version, 0)
    return round(dev_stats.utility_by_version.get(version, 0.0) / n, 4) if n else None


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}%"


def _reward_model_cell(v: dict[str, Any]) -> str:
    """Which model scored the update's sessions (and how many), and what its retrain registered."""
    parts = []
    if v.get("reward_model"):
        parts.append(f"scored {int(v.get('reward_model_scored') or 0)} with {v['reward_model']}")
    if v.get("reward_model_trained"):
        metric = f" {v['reward_model_metric']:.3f}" if v.get("reward_model_metric") is not None else ""
        parts.append(f"trained {v['reward_model_trained']} ({v['reward_model_trained_status']}{metric})")
    return "; ".join(parts) or "-"


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """The per-version table and the headline, on the terminal."""
    console = console or Console()
    table = Table(title=f"Undertow demo: policy versions ({report['minutes']:.1f} min)")
    cols = ("version", "what", "held-out task success", "held-out retention", "held-out acceptance")
    for col in (*cols, "online req", "online accept"):
        table.add_column(col, justify="right" if "held" in col or "online" in col else "left")
    table.add_column("reward model")
    table.add_column("rollout")
    for v in report["versions"]:
        rm = _reward_model_cell(v)
        outcome = v["rollout"] + (f": {v['rollout_message'][:60]}" if v["rollout"] == "rolled_back" else "")
        table.add_row(
            v["version"],
            str(v["label"]),
            _pct(v["heldout_task_success"]),
            _pct(v["heldout_retention"]),
            _pct(v["heldout_acceptance"]),
            str(v["online_requests"]),
            _pct(v["online_acceptance"]),
            rm,
            outcome,
        )
    console.print(table)
    measured_on = report.get("gain_measured_on")

    def target(on: str) -> str:
        return "; gain_points, target +10, printed, not asserted" if on == measured_on else ""

    if report["v0_heldout_task_success"] is not None:
        console.print(
            f"agent held-out task success: v0 {_pct(report['v0_heldout_task_success'])} -> serving "
            f"{report['final_version']} {_pct(report['final_heldout_task_success'])} "
            f"({report['task_success_gain_points']:+.1f} points{target('heldout_task_success')}); agent sessions "
            f"served: mean turns {report['mean_turns']}, {report['sessions_with_summary']} with a self-summary"
        )
    if report.get("true_utility_gain_points") is not None:
        console.print(
            f"held-out true utility (the population's, never sent): v0 {_pct(report['v0_heldout_true_utility'])} -> "
            f"serving {report['final_version']} {_pct(report['final_heldout_true_utility'])} "
            f"({report['true_utility_gain_points']:+.1f} points{target('heldout_true_utility')})"
        )
    console.print(
        f"held-out retention: v0 {_pct(report['v0_heldout_retention'])} -> serving {report['final_version']} "
        f"{_pct(report['final_heldout_retention'])} ({report['retention_gain_points']:+.1f} points"
        f"{target('retention')}); rollbacks: {report['rollbacks']}"
    )
    if report["failed_updates"]:
        console.print(f"updates that failed: {report['failed_updates']}")
