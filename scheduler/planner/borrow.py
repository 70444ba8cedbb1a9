"""Borrowing a serving replica: its state machine, the time each step takes, and preemption.

    training:    serving -> draining -> sleeping -> lent -> checkpointing -> waking -> verifying -> serving
    generation:  serving -> draining -> lent -> verifying -> serving

Draining takes the replica out of the gateway's rotation and lets in-flight requests finish.
A training replica then sleeps (vLLM ``/sleep?level=1`` frees its accelerator memory) and runs
the RL update; returning it checkpoints the training job (it yields at a step boundary, nothing
is lost), wakes the engine (``/wake_up``), verifies it serves the expected weights version and
puts it back in rotation. A generation replica samples extra candidates for production prompts
with the *serving* version (on-policy for the telemetry it completes), so it stays awake with
the serving weights: it is recalled by aborting its rollouts, verifying the version, and
rejoining, within seconds. That makes the generation share of borrowed capacity a hot reserve
that absorbs bursts shorter than a training replica's return. A replica may be recalled from any
borrowed state. The same machine drives the
simulator (with :class:`BorrowTimings`) and the Celery tasks (with the serving fleet's calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class ReplicaState(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    LENT = "lent"
    CHECKPOINTING = "checkpointing"
    WAKING = "waking"
    VERIFYING = "verifying"


TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.SERVING: frozenset({ReplicaState.DRAINING}),
    ReplicaState.DRAINING: frozenset({ReplicaState.SLEEPING, ReplicaState.LENT, ReplicaState.SERVING}),
    ReplicaState.SLEEPING: frozenset({ReplicaState.LENT, ReplicaState.WAKING}),
    ReplicaState.LENT: frozenset({ReplicaState.CHECKPOINTING, ReplicaState.WAKING, ReplicaState.VERIFYING}),
    ReplicaState.CHECKPOINTING: frozenset({ReplicaState.WAKING}),
    ReplicaState.WAKING: frozenset({ReplicaState.VERIFYING}),
    ReplicaState.VERIFYING: frozenset({ReplicaState.SERVING, ReplicaState.WAKING}),
}
BORROWED = frozenset(set(ReplicaState) - {ReplicaState.SERVING})


class IllegalTransition(RuntimeError):
    """A replica was asked to move to a state it cannot reach from where it is."""


def check_transition(current: ReplicaState, target: ReplicaState) -> ReplicaState:
    """``target`` when the move is allowed, else :class:`IllegalTransition`."""
    if target not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(TRANSITIONS[current]))
        raise IllegalTransition(f"replica in state {current} cannot move to {target} (allowed: {allowed})")
    return target


def return_path(current: ReplicaState, generation: bool = False) -> list[ReplicaState]:
    """States a borrowed replica walks through to serve again, starting from ``current``."""
    if current is ReplicaState.SERVING:
        return []
    if current is ReplicaState.DRAINING:
        return [ReplicaState.SERVING]
    lent_path = (
        [ReplicaState.VERIFYING]
        if generation
        else [ReplicaState.CHECKPOINTING, ReplicaState.WAKING, ReplicaState.VERIFYING]
    )
    path = {
        ReplicaState.LENT: lent_path,
        ReplicaState.SLEEPING: [ReplicaState.WAKING, ReplicaState.VERIFYING],
        ReplicaState.CHECKPOINTING: [ReplicaState.WAKING, ReplicaState.VERIFYING],
        ReplicaState.WAKING: [ReplicaState.VERIFYING],
        ReplicaState.VERIFYING: [],
    }[current]
    return [*path, ReplicaState.SERVING]


@dataclass(frozen=True)
class BorrowTimings:
    """Seconds each step of lending and returning a replica takes."""

    drain_s: float = 20.0
    sleep_s: float = 5.0
    checkpoint_s: float = 15.0
    wake_s: float = 20.0
    verify_s: float = 5.0
    generation_return_s: float = 2.0

    @property
    def lend_s(self) -> float:
        """From leaving rotation to being usable by the borrower."""
        return self.drain_s + self.sleep_s

    @property
    def return_s(self) -> float:
        """From a recall to serving again (checkpoint, wake, verify and rejoin)."""
        return self.checkpoint_s + self.wake_s + self.verify_s


def replicas_to_recall(
    demand_rps: float,
    serving: int,
    borrowed: int,
    capacity_rps: float,
    headroom: float,
    trigger_utilization: float,
) -> int:
    """Borrowed replicas to hand back now because demand outgrew the plan.

    Nothing happens while ``demand <= trigger * serving * capacity``; past that, enough replicas
    come back to serve the demand with the planned headroom again (bounded by what is borrowed).
    """
    if borrowed <= 0 or demand_rps <= trigger_utilization * serving * capacity_rps:
        return 0
    want = math.ceil(demand_rps * (1.0 + headroom) / capacity_rps - 1e-9) - serving
    return max(1, min(borrowed, want))
