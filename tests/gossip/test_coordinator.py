"""The coordinator: lowest (priority, id) among the live, the incumbent kept, epochs that only grow."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpubroker.gossip.coordinator import Candidate, Coordinator, choose, merge, provisional
from gpubroker.gossip.messages import MemberState

A, B, C = Candidate(0, "n-a"), Candidate(0, "n-b"), Candidate(1, "n-0")
ALIVE, SUSPECT, DEAD, LEFT = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


def test_the_first_coordinator_is_the_live_node_with_the_lowest_priority_then_id() -> None:
    chosen = choose(None, {C: ALIVE, B: ALIVE, A: ALIVE})
    assert chosen == Coordinator("n-a", 0, 1)


def test_a_suspected_incumbent_stays() -> None:
    current = Coordinator("n-a", 0, 4)
    assert choose(current, {A: SUSPECT, B: ALIVE}) is current


def test_a_dead_or_departed_incumbent_is_replaced_with_a_higher_epoch() -> None:
    current = Coordinator("n-a", 0, 4)
    for gone in (DEAD, LEFT):
        assert choose(current, {A: gone, B: ALIVE, C: ALIVE}) == Coordinator("n-b", 0, 5)


def test_a_returning_node_with_a_lower_id_does_not_take_over() -> None:
    current = Coordinator("n-b", 0, 5)
    assert choose(current, {A: ALIVE, B: ALIVE}) is current


def test_after_a_healed_partition_the_higher_epoch_wins_then_the_lower_priority_and_id() -> None:
    left, right = Coordinator("n-b", 0, 7), Coordinator("n-a", 0, 6)
    assert merge(left, right) == left
    assert merge(right, left) == left
    tie_a, tie_b = Coordinator("n-b", 0, 7), Coordinator("n-a", 0, 7)
    assert merge(tie_a, tie_b) == tie_b
    assert merge(None, tie_a) == tie_a


def test_a_newcomers_own_choice_never_beats_an_announced_coordinator_even_with_a_lower_id() -> None:
    incumbent = Coordinator("n-b", 0, 1)  # announced by the cluster the newcomer n-a joins
    mine = provisional({A: ALIVE, B: ALIVE})
    assert mine == Coordinator("n-a", 0, 0)
    assert merge(mine, incumbent) == incumbent
    assert merge(incumbent, mine) == incumbent
    assert choose(incumbent, {A: ALIVE, B: ALIVE}) is incumbent


def test_a_provisional_choice_nobody_outranks_is_announced_at_epoch_1_as_the_best_live_node() -> None:
    assert choose(Coordinator("n-b", 0, 0), {A: ALIVE, B: ALIVE}) == Coordinator("n-a", 0, 1)  # no incumbent yet
    assert provisional({A: DEAD, B: LEFT}) is None


@given(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["n-a", "n-b", "n-c", "n-d"])), min_size=1, max_size=4, unique_by=lambda t: t[1]),
    st.lists(st.sampled_from(list(MemberState)), min_size=4, max_size=4),
    st.integers(0, 50),
)
def test_epochs_only_grow_and_the_coordinator_is_never_a_gone_node_while_one_lives(
    nodes: list[tuple[int, str]], states: list[MemberState], epoch: int
) -> None:
    members = {Candidate(p, n): s for (p, n), s in zip(nodes, states, strict=False)}
    current = Coordinator(nodes[0][1], nodes[0][0], epoch)
    chosen = choose(current, members)
    assert chosen is not None
    assert chosen.epoch >= epoch
    if any(s in (ALIVE, SUSPECT) for s in members.values()):
        state = next(s for c, s in members.items() if c.node == chosen.node)
        assert state in (ALIVE, SUSPECT)
