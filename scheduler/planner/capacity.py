"""Capacity plan: a replica's capacity at the latency SLO, how many replicas a pool needs, how many
it can lend, and how borrowed replicas split between rollout generation and training.

    capacity_at_slo = max{ load : p99_latency(load) <= SLO }        (measured load/latency curve)
    needed          = ceil( forecast_peak * (1 + headroom) / capacity_at_slo )
    lendable        = clamp( replicas - needed, 0, replicas - min_serving )

Generation and training share the borrowed replicas in proportion to their measured cost per
token, so both stages of an RL step finish together (neither waits on the other):

    generation_share = c_gen / (c_gen + c_train)
    generation       = max( generation_share * n, min(hot_reserve, max_generation_share * n) )

Derivation of the default. Every token of an RL step is generated once and trained on once. A
forward pass costs about ``2N`` FLOPs per token for ``N`` parameters and a backward pass about
``4N`` (Kaplan et al., *Scaling Laws for Neural Language Models*, 2020, sec. 2.1), so training
costs ``c_train = 3`` forward passes per token and generation ``c_gen = 1``. For both stages to
keep pace, replica-time must split as the work does: generation gets ``1 / (1 + 3) = 1/4`` of the
borrowed replicas, training ``3/4``. Decoding is memory-bound and runs at about two thirds of
training's per-FLOP efficiency, so in seconds ``c_gen = 1.5``: ``1.5 / 4.5 = 1/3`` generates, the
default; a fleet that measures its own seconds per token configures them.

The hot reserve (``hot_reserve``) moves borrowed replicas from training to generation, up to
``max_generation_share`` of them, when the forecaster's tail says a burst could outgrow the planned
serving set: generation replicas are back within seconds, training ones in tens of seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def capacity_at_slo(load_rps: Sequence[float], p99_latency_s: Sequence[float], slo_s: float) -> float:
    """Largest load whose p99 latency meets the SLO, interpolated on a measured load/latency curve.

    Points are sorted by load; latency is taken as non-decreasing in load (running maximum), so a
    noisy measurement cannot make the capacity jump. Raises ``ValueError`` when no point meets it.
    """
    if len(load_rps) != len(p99_latency_s) or not load_rps:
        raise ValueError("capacity_at_slo needs equally long, non-empty load and latency sequences")
    points = sorted(zip(load_rps, p99_latency_s, strict=True))
    loads = [p[0] for p in points]
    lat: list[float] = []
    for _, v in points:
        lat.append(max(v, lat[-1]) if lat else v)
    if lat[0] > slo_s:
        raise ValueError(
            f"even the lightest measured load ({loads[0]:g} rps) has p99 {lat[0]:g} s over the SLO {slo_s:g} s"
        )
    for i in range(1, len(loads)):
        if lat[i] > slo_s:
            frac = (slo_s - lat[i - 1]) / (lat[i] - lat[i - 1])
            return loads[i - 1] + frac * (loads[i] - loads[i - 1])
    return loads[-1]


def queueing_p99_latency(load_rps: float, max_rps: float, base_latency_s: float) -> float:
    """p99 latency of a replica modelled as an M/M/1 queue scaled to its unloaded latency.

    ``base / (1 - rho)`` with ``rho = load / max_rps`` (Kleinrock, *Queueing Systems* I, 3.2):
    the simulator's load/latency curve when no measurements exist. Infinite at saturation.
    """
    rho = load_rps / max_rps
    if rho >= 1:
        return math.inf
    return base_latency_s / (1.0 - rho)


def replicas_needed(demand_rps: float, capacity_rps: float, headroom: float) -> int:
    """Replicas that serve ``demand_rps`` with ``headroom`` spare capacity at the SLO."""
    if capacity_rps <= 0:
        raise ValueError("replica capacity must be positive")
    return max(0, math.ceil(demand_rps * (1.0 + headroom) / capacity_rps - 1e-9))


def lendable_replicas(replicas: int, needed: int, min_serving: int) -> int:
    """Replicas a pool can lend for the next window."""
    return max(0, min(replicas - needed, replicas - min_serving))


def split_borrowed(
    n: int, generation_cost: float, training_cost: float, reserve: int = 0, max_generation_share: float = 1.0
) -> tuple[int, int]:
    """``(generation, training)`` replicas out of ``n`` borrowed, in proportion to cost per token.

    Each stage gets at least one replica once two or more are borrowed (a lone replica trains:
    the rollouts then come from the serving fleet's own telemetry). ``reserve`` asks for that many
    hot (generation) replicas: generation then gets ``min(reserve, ceil(max_generation_share * n))``
    when that is more than its cost share (see :func:`hot_reserve`).
    """
    if n <= 0:
        return 0, 0
    if n == 1:
        return 0, 1
    share = generation_cost / (generation_cost + training_cost)
    gen = max(1, round(n * share), min(reserve, math.ceil(max_generation_share * n - 1e-9)))
    gen = min(n - 1, gen)
    return gen, n - gen


def hot_fraction(generation_return_s: float, burst_interval_s: float) -> float:
    """Share of a burst interval that a recalled generation replica serves (it needs ``generation_return_s``)."""
    return max(0.0, 1.0 - generation_return_s / burst_interval_s)


def hot_reserve(tail_rps: float, upper_rps: float, capacity_rps: float, headroom: float, hot_fraction: float) -> int:
    """Generation replicas that absorb a burst up to the tail forecast beyond the planned serving set.

        reserve = ceil( (needed(tail) - needed(upper)) / hot_fraction )

    A generation replica keeps the serving weights awake: recalled, it aborts its rollouts and
    serves within ``generation_return_s``, i.e. ``hot_fraction = 1 - generation_return_s / tau``
    of its capacity over the burst interval ``tau``. Training replicas sleep and need tens of
    seconds (checkpoint, wake, verify), longer than a burst, so only the generation share can
    absorb one; its extra rollouts feed larger GRPO candidate groups.
    """
    if hot_fraction <= 0:
        return 0
    extra = replicas_needed(tail_rps, capacity_rps, headroom) - replicas_needed(upper_rps, capacity_rps, headroom)
    return max(0, math.ceil(extra / hot_fraction - 1e-9))
