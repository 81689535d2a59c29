"""Lifeguard's timers, pure: the suspicion timeout that independent confirmations shrink, and the local health score.

After HashiCorp memberlist's suspicion.go and awareness.go; times are seconds, passed in, never read from a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def suspicion_timeout(suspicion_mult: int, n: int, probe_interval: float) -> float:
    """The shortest suspicion (memberlist's `suspicionTimeout`): mult × max(1, log10(n)) × probe interval.

    The floor of 1 is memberlist's: below ten members the timeout does not shrink further, so a
    three-node cluster waits suspicion_mult probe intervals, not 1.9 of them.
    """
    scale = max(1.0, math.log10(max(1.0, float(n))))
    return suspicion_mult * scale * probe_interval


def expected_confirmations(suspicion_mult: int, n: int) -> int:
    """k: the confirmations a suspicion waits for; 0 when the cluster is too small to give them (n − 2 < k)."""
    k = suspicion_mult - 2
    return 0 if n - 2 < k else k


def suspicion_duration(confirmations: int, k: int, minimum: float, maximum: float) -> float:
    """Total time from the start of a suspicion to its end after `confirmations` independent ones (memberlist's formula).

    max − (max − min) × log(c + 1) / log(k + 1), never under min; with k = 0 it is min from the start.
    """
    if k < 1:
        return minimum
    frac = math.log(confirmations + 1.0) / math.log(k + 1.0)
    raw = maximum - frac * (maximum - minimum)
    raw = math.floor(raw * 1000.0) / 1000.0  # memberlist rounds down to the millisecond
    return max(minimum, raw)


@dataclass
class Suspicion:
    """One member under suspicion: started at `start` by `source`; `deadline` moves earlier with each new confirmer."""

    start: float
    k: int
    minimum: float
    maximum: float
    source: str
    confirmers: set[str] = field(default_factory=set)
    confirmations: int = 0

    def __post_init__(self) -> None:
        # The accuser is never its own confirmation: only other members' suspicions are independent.
        self.confirmers.add(self.source)

    @property
    def deadline(self) -> float:
        return self.start + suspicion_duration(self.confirmations, self.k, self.minimum, self.maximum)

    def confirm(self, source: str) -> bool:
        """Count a Suspect from `source`; True when it was new (the caller then re-gossips it), False otherwise."""
        if self.confirmations >= self.k or source in self.confirmers:
            return False
        self.confirmers.add(source)
        self.confirmations += 1
        return True


@dataclass
class Awareness:
    """Lifeguard's local health multiplier: score in [0, max − 1]; 0 is healthy; timeouts scale by score + 1."""

    maximum: int
    score: int = 0

    def apply(self, delta: int) -> None:
        self.score = min(max(self.score + delta, 0), self.maximum - 1)

    def scale(self, timeout: float) -> float:
        return timeout * (self.score + 1)
