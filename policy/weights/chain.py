"""Cheapest path from the version a replica holds to a target.

The versions form a graph: a delta is an edge from its base to its version, weighted by its
size; a full snapshot is an edge from "nothing" to its version, weighted by its size. Dijkstra
from the held version (cost 0) and from "nothing" finds the path that reads the fewest bytes.
The serving layer's updater (:mod:`serving.weights`) stages the path step by step, verifying
each artifact before it is used; when one is corrupt or missing it excludes it and plans again
(ending, at worst, at the nearest full snapshot).

Rollback needs no artifact of its own: deltas only point forward (parent to child), so going
from a newer held version back to an older one is planned like any path: the nearest full
snapshot at or before the target, then the forward deltas up to it. Its cost is bounded by one
snapshot plus ``snapshot_every - 1`` deltas. Reverse deltas (child to parent) would make a
one-version rollback as cheap as a forward step; they are left out because rollback is rare
(an incident, not the steady state), its cost is already bounded, and they would double the
bytes written per version. (A replica's usual rollback, to the version it held just before,
is a local revert of the sparse undo it keeps, with no store read.)
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from policy.weights.format import Manifest, VersionHead, WeightsError


@dataclass(frozen=True)
class Step:
    """Apply one artifact: ``full`` (snapshot) or ``delta`` of ``version``."""

    kind: str
    version: str
    bytes: int


def plan(
    manifests: Iterable[Manifest] | Iterable[VersionHead],
    target: str,
    held: str | None = None,
    exclude: frozenset[tuple[str, str]] = frozenset(),
) -> list[Step]:
    """The cheapest list of steps from ``held`` (None: nothing) to ``target``; [] if already there.

    ``exclude`` holds ``(kind, version)`` artifacts known to be bad. Raises :class:`WeightsError`
    when no path exists.
    """
    by_version = {m.version: m for m in manifests}
    if target not in by_version:
        raise WeightsError(f"version {target} is not in the store")
    if held == target:
        return []
    children: dict[str, list[Manifest | VersionHead]] = {}
    for m in by_version.values():
        if m.delta is not None and ("delta", m.version) not in exclude:
            children.setdefault(m.delta.base, []).append(m)
    best: dict[str, tuple[int, list[Step]]] = {}
    queue: list[tuple[int, int, str, list[Step]]] = []
    counter = 0
    if held is not None and held in by_version:
        queue.append((0, counter, held, []))
    for m in by_version.values():
        if m.full is not None and ("full", m.version) not in exclude:
            counter += 1
            queue.append((m.full.bytes, counter, m.version, [Step("full", m.version, m.full.bytes)]))
    heapq.heapify(queue)
    while queue:
        cost, _, version, steps = heapq.heappop(queue)
        if version in best:
            continue
        best[version] = (cost, steps)
        if version == target:
            return steps
        for child in children.get(version, []):
            if child.version not in best and child.delta is not None:
                counter += 1
                step = Step("delta", child.version, child.delta.bytes)
                heapq.heappush(queue, (cost + child.delta.bytes, counter, child.version, [*steps, step]))
    raise WeightsError(
        f"no path to version {target} from {held or 'nothing'}: every snapshot and delta is missing or bad"
    )
