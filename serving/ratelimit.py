"""Token buckets per client and per user: how fast the gateway lets anyone call it.

Each bucket holds up to ``burst`` tokens and refills at ``rate`` per second; a call takes one
token or is refused with the seconds until one is back (the ``Retry-After`` of a 429). Buckets
are kept for the most recently seen keys only (``max_keys``): a forgotten bucket comes back full,
which costs an attacker nothing they could not get by waiting ``burst / rate`` seconds.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable


class Buckets:
    """One token bucket per key, bounded in number."""

    def __init__(
        self, rate: float, burst: float, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str, rate: float | None = None) -> float:
        """Take one token for ``key``; 0.0 when allowed, else the seconds until a token is back.

        ``rate`` overrides the default refill rate for this key (the burst scales with it).
        """
        rate = rate or self.rate
        burst = self.burst * rate / self.rate if rate != self.rate else self.burst
        now = self.clock()
        tokens, at = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - at) * rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            self._buckets.move_to_end(key)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return 0.0
        self._buckets[key] = (tokens, now)
        self._buckets.move_to_end(key)
        return (1.0 - tokens) / rate

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """A ``Retry-After`` header value (whole seconds, at least 1)."""
        return str(max(1, math.ceil(wait_s)))
