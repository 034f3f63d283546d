"""The aligned pull's step, chosen from every rank's Status (deltad.consume.align), alone."""

from __future__ import annotations

from deltad.consume.align import Alignment, align, source_unix, unaligned
from deltad.consume.sidecars import RankStatus


def _st(
    rank: int,
    head_step: int,
    *,
    generation: int = 1,
    head_seq: int = 3,
    steps: tuple[int, ...] = (),
    dense: tuple[int, ...] = (),
    cap: int | None = None,
    asked: float = 100.0,
    age: float = 0.0,
) -> RankStatus:
    return RankStatus(
        rank, 2, generation, head_seq, head_step, age, asked, dense, steps, cap_step=cap
    )


def test_ranks_with_nothing_published_or_two_generations_are_not_aligned_yet() -> None:
    assert unaligned([_st(0, 5), _st(1, 5)]) == {}
    assert unaligned([_st(0, 5), _st(1, -1, head_seq=-1)]) == {
        0: "generation 1 head seq 3: ranks not aligned yet",
        1: "nothing published yet",
    }
    assert unaligned([_st(0, 5), _st(1, 5, generation=2)])[1] == (
        "generation 2 head seq 3: ranks not aligned yet"
    )


def test_the_target_is_the_lowest_head_capped_by_the_release_and_max_step() -> None:
    ranks = [_st(0, 7), _st(1, 5)]
    assert align(ranks, None, False) == Alignment(5, 7, None, 7)
    assert align(ranks, 4, False).target == 4
    capped = [_st(0, 7, steps=(2, 3, 6, 7), cap=6), _st(1, 5, steps=(2, 5))]
    # capped at 6: the release step is the newest end at or below it
    assert align(capped, None, False) == Alignment(5, 7, 6, 6)
    low = [_st(0, 7, steps=(2, 3, 7), cap=4), _st(1, 5, steps=(2, 5), cap=6)]
    assert align(low, None, False) == Alignment(4, 7, 4, 3)


def test_with_dense_the_target_is_a_step_with_a_dense_state() -> None:
    ranks = [_st(0, 5, steps=(1, 3, 5), dense=(1, 3)), _st(1, 5, steps=(1, 3, 5))]
    assert align(ranks, None, True).target == 3
    assert align(ranks, None, False).target == 5


def test_the_source_time_is_the_newest_publish_of_the_step_at_a_head() -> None:
    ranks = [_st(0, 5, asked=100.0, age=2.0), _st(1, 5, asked=100.0, age=1.0), _st(2, 4)]
    assert source_unix(ranks, 5) == 99.0
    assert source_unix(ranks, 3) is None
