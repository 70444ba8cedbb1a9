"""Pools in several regions, each with its own daily phase: borrow where it is night.

A training job asks for ``wanted`` replicas for the next window; every pool offers what its own
plan says it can lend. :func:`allocate` takes first from the pools whose lendable share is
largest (deepest in their night: least demand per replica, so least likely to be recalled), then
from the next, never more than a pool offers. Ties go to the pool with more spare replicas, then
by name, so the choice is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolOffer:
    """What one pool can lend for the next window."""

    name: str
    replicas: int
    lendable: int

    @property
    def spare_share(self) -> float:
        return self.lendable / self.replicas if self.replicas else 0.0


def local_hour(t_s: float, utc_offset_h: float) -> float:
    """Hour of day (0-24) in a pool's region at trace time ``t_s``."""
    return ((t_s / 3600.0) + utc_offset_h) % 24.0


def allocate(offers: list[PoolOffer], wanted: int) -> dict[str, int]:
    """Replicas to borrow from each pool (pools with nothing to give are left out)."""
    if wanted < 0:
        raise ValueError("cannot borrow a negative number of replicas")
    out: dict[str, int] = {}
    left = wanted
    for offer in sorted(offers, key=lambda o: (-o.spare_share, -o.lendable, o.name)):
        if left <= 0:
            break
        take = min(offer.lendable, left)
        if take > 0:
            out[offer.name] = take
            left -= take
    return out
