"""The coordinator (SPEC §7): the live node with the lowest (priority, id), kept while it lives. Pure.

Each node works the coordinator out from its own view of the membership and announces it with
an epoch (in its node document). The incumbent stays until it is dead or has left: a passing
suspicion changes nothing, and a returning node with a lower id does not take over. When two
announcements meet (after a healed partition), the higher epoch wins, then the lower
(priority, id). The coordinator is trusted for advisory work only; it never grants on another
node's GPUs.

A node that has not yet heard what the others announce (it has just started or joined) holds a
provisional choice, at epoch 0, which it does not announce: any announced coordinator wins over it,
so a newcomer with a lower id never takes over from the incumbent it has not heard of yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpubroker.gossip.messages import MemberState

GONE = (MemberState.DEAD, MemberState.LEFT)
PROVISIONAL = 0  # the epoch of a choice not announced yet; announced coordinators have epochs from 1


@dataclass(frozen=True, slots=True, order=True)
class Candidate:
    priority: int  # lower is preferred; from the node's configuration
    node: str


@dataclass(frozen=True, slots=True)
class Coordinator:
    node: str
    priority: int
    epoch: int

    @property
    def rank(self) -> tuple[int, int, str]:
        """Sorts the announcement that wins first: higher epoch, then lower (priority, id)."""
        return -self.epoch, self.priority, self.node


def provisional(members: Mapping[Candidate, MemberState]) -> Coordinator | None:
    """The best live node, as a choice not to announce before hearing the others' (epoch 0: any announcement wins)."""
    live = sorted(c for c, s in members.items() if s not in GONE)
    return Coordinator(live[0].node, live[0].priority, PROVISIONAL) if live else None


def choose(current: Coordinator | None, members: Mapping[Candidate, MemberState]) -> Coordinator | None:
    """The coordinator after this view of the membership: the incumbent while it lives, else the best live node
    (a provisional choice is no incumbent: it is made again, to be announced at epoch 1)."""
    if current is not None and current.epoch > PROVISIONAL:
        state = next((s for c, s in members.items() if c.node == current.node), None)
        if state is not None and state not in GONE:
            return current  # alive or merely suspected: it stays
    live = sorted(c for c, s in members.items() if s not in GONE)
    if not live:
        return current
    best = live[0]
    return Coordinator(best.node, best.priority, (current.epoch if current else 0) + 1)


def merge(mine: Coordinator | None, theirs: Coordinator | None) -> Coordinator | None:
    """Two announcements meet: the higher epoch wins, then the lower (priority, id)."""
    if mine is None or theirs is None:
        return mine or theirs
    return min(mine, theirs, key=lambda c: c.rank)
