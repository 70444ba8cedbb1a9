"""Retention and garbage collection that never deletes what a replica still needs.

A version is needed when a replica holds it (``in_use``: the caller passes the fleet's versions),
when it is among the newest ``retain_last``, or when it is the latest. For each needed version
GC keeps what rebuilds it (its chain back to the nearest full snapshot), and for a held version
that is an ancestor of the latest it keeps the deltas from it up to the latest, so the replica's
next update stays a cheap delta. Everything else goes, manifest first. Incomplete directories
(a write that crashed before its manifest) are removed once older than ``stale_write_s``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from policy.weights.format import Manifest
from policy.weights.store import WeightStore

log = structlog.get_logger(__name__)


@dataclass
class GcPlan:
    """What GC keeps and deletes."""

    keep: list[str] = field(default_factory=list)
    """Complete versions kept."""
    delete: list[str] = field(default_factory=list)
    """Complete versions deleted."""
    incomplete: list[str] = field(default_factory=list)
    """Stale incomplete directories deleted."""
    unknown_in_use: list[str] = field(default_factory=list)
    """In-use versions the store does not have (reported, not an error)."""


def _chain(by_version: dict[str, Manifest], version: str) -> list[str]:
    out = [version]
    while by_version[out[-1]].full is None:
        parent = by_version[out[-1]].parent
        if parent is None or parent not in by_version:
            break
        out.append(parent)
    return out


def plan_gc(manifests: Iterable[Manifest], in_use: Iterable[str], retain_last: int) -> GcPlan:
    """Decide which complete versions to keep (pure function of the manifests and the in-use set)."""
    ordered = sorted(manifests, key=lambda m: m.seq)
    by_version = {m.version: m for m in ordered}
    held = set(in_use)
    needed = {v for v in held if v in by_version} | {m.version for m in ordered[-retain_last:]}
    keep: set[str] = set()
    for version in needed:
        keep.update(_chain(by_version, version))
    if ordered:
        latest = ordered[-1].version
        lineage = []
        cursor: str | None = latest
        while cursor is not None and cursor in by_version:
            lineage.append(cursor)
            cursor = by_version[cursor].parent
        for version in held & set(lineage):
            keep.update(lineage[: lineage.index(version) + 1])
    return GcPlan(
        keep=[m.version for m in ordered if m.version in keep],
        delete=[m.version for m in ordered if m.version not in keep],
        unknown_in_use=sorted(held - set(by_version)),
    )


def collect(
    store: WeightStore, in_use: Iterable[str], *, retain_last: int | None = None, dry_run: bool = False
) -> GcPlan:
    """Plan and (unless ``dry_run``) carry out garbage collection on ``store``."""
    config = store.config
    manifests = store.manifests()
    plan = plan_gc(manifests, in_use, retain_last or config.retain_last)
    complete = {m.version for m in manifests}
    now = time.time()
    for version in store.version_ids():
        if version not in complete and now - store.modified_at(version) > config.stale_write_s:
            plan.incomplete.append(version)
    if not dry_run:
        for version in plan.delete + plan.incomplete:
            store.delete(version)
            log.info("weights.gc_deleted", version=version)
    return plan
