"""The GetDelta window decision and the request check, alone: pure functions of (request,
stored cursor, log view), no servers (deltad.serve.windows.decide)."""

from __future__ import annotations

import math

import pytest

from deltad.serve.state.offsets import StoredCursor
from deltad.serve.windows.decide import LogView, WindowAsk, check_request, decide_window
from deltad.v1 import delta_pb2 as pb

#: generation 3: base at seq 4 (step 40, a merge), deltas 5..8 at steps 50..80
LOG = LogView(3, ((4, 40), (5, 50), (6, 60), (7, 70), (8, 80)))


def cur(seq: int, step: int | None = None, generation: int = 3, owed: str = "") -> StoredCursor:
    return StoredCursor(generation, seq, seq * 10 if step is None else step, owed_token=owed)


def window(d: object) -> tuple[bool, int, int, int, str]:
    return (d.resync, d.from_seq, d.to_seq, d.to_step, d.reason)  # type: ignore[attr-defined]


def test_after_the_cursor_up_to_the_head() -> None:
    d = decide_window(WindowAsk("c"), cur(6), LOG)
    assert window(d) == (False, 6, 8, 80, "cursor") and d.owed_token == "" and not d.refusal


@pytest.mark.parametrize(
    ("stored", "ask", "reason"),
    [
        (None, WindowAsk("c"), "no cursor"),
        (
            cur(9, generation=2),
            WindowAsk("c"),
            "new generation: the previous generation's log is not held",
        ),
        (cur(2), WindowAsk("c"), "behind the base"),  # merged past an expired consumer
        (cur(6), WindowAsk("c", from_base=True), "asked"),
    ],
)
def test_resync_from_the_base(stored: StoredCursor | None, ask: WindowAsk, reason: str) -> None:
    d = decide_window(ask, stored, LOG)
    assert window(d) == (True, -1, 8, 80, reason) and d.owed_token == ""


def test_max_step_ends_the_window_at_the_newest_entry_at_or_before_it() -> None:
    assert window(decide_window(WindowAsk("c", max_step=65), cur(5), LOG))[1:4] == (5, 6, 60)
    assert window(decide_window(WindowAsk("c", max_step=70), cur(5), LOG))[1:4] == (5, 7, 70)
    # below every delta: the base (a resync needs no more)
    assert window(decide_window(WindowAsk("c", max_step=1), None, LOG))[1:4] == (-1, 4, 40)


def test_a_window_never_ends_before_the_cursor() -> None:
    # nothing new at or below max_step: an empty window at the cursor, with its step
    d = decide_window(WindowAsk("c", max_step=55), cur(7, step=71), LOG)
    assert window(d) == (False, 7, 7, 71, "cursor")
    # the cursor at the head: empty too
    assert window(decide_window(WindowAsk("c"), cur(8), LOG)) == (False, 8, 8, 80, "cursor")
    # an asked-for resync behind the cursor would be refused at commit: it goes to the head
    d = decide_window(WindowAsk("c", from_base=True, max_step=55), cur(7), LOG)
    assert window(d) == (True, -1, 8, 80, "asked")
    # ...but a cursor of an older generation does not hold a resync back
    d = decide_window(WindowAsk("c", max_step=55), cur(7, generation=2), LOG)
    assert window(d) == (
        True,
        -1,
        5,
        50,
        "new generation: the previous generation's log is not held",
    )


#: generation 2, held after the switch to LOG's generation 3: base at seq 1, deltas 2..6
PREV = LogView(2, ((1, 10), (2, 20), (3, 30), (4, 40), (5, 50), (6, 60)))


def test_a_cursor_of_the_held_previous_generation_gets_a_generation_diff() -> None:
    d = decide_window(WindowAsk("c", max_step=65), cur(3, generation=2, owed="t"), LOG, PREV)
    assert window(d) == (False, -1, 6, 60, "generation diff")
    assert d.diff_from == (2, 3) and d.owed_token == "t"  # the old owed rows go in the diff
    # at the held log's base and head: a diff too
    for seq in (1, 6):
        assert decide_window(WindowAsk("c"), cur(seq, generation=2), LOG, PREV).diff_from == (
            2,
            seq,
        )


@pytest.mark.parametrize(
    ("stored", "ask", "previous", "why"),
    [
        (cur(0, generation=2), WindowAsk("c"), PREV, "is behind the held log's base 1"),
        (cur(7, generation=2), WindowAsk("c"), PREV, "is past the held log's head 6"),
        (
            cur(5, generation=2),
            WindowAsk("c"),
            LogView(2, ((1, 10), (3, 30), (6, 60))),  # 4..6 merged
            "inside a merged segment",
        ),
        (cur(3, generation=1), WindowAsk("c"), PREV, "the log held is of generation 2"),
        (cur(3, generation=2), WindowAsk("c", no_diff=True), PREV, "no generation diff asked"),
        (cur(3, generation=2), WindowAsk("c"), None, "dropped after 9 s"),
    ],
)
def test_no_generation_diff_is_a_resync_that_says_why(
    stored: StoredCursor, ask: WindowAsk, previous: LogView | None, why: str
) -> None:
    d = decide_window(ask, stored, LOG, previous, "generation 2's log was dropped after 9 s")
    assert d.resync and d.diff_from is None and d.owed_token == "" and d.from_seq == -1
    assert d.reason.startswith("new generation: ") and why in d.reason, d.reason
    # from_base keeps meaning a full resync, whatever is held
    d = decide_window(WindowAsk("c", from_base=True), cur(3, generation=2), LOG, PREV)
    assert d.resync and d.diff_from is None and d.reason == "asked"
    # a diff turned down later (tables changed): a resync with the reason, no diff left
    d = decide_window(WindowAsk("c"), cur(3, generation=2, owed="t"), LOG, PREV)
    r = d.resynced("new generation: tables changed: t0")
    assert r.resync and r.diff_from is None and r.owed_token == "" and r.from_seq == -1


def test_owed_rows_come_with_a_window_after_the_cursor_only() -> None:
    d = decide_window(WindowAsk("c"), cur(6, owed="tok"), LOG)
    assert d.owed_token == "tok" and not d.resync
    assert decide_window(WindowAsk("c", from_base=True), cur(6, owed="tok"), LOG).owed_token == ""
    lost = d.resynced("owed rows lost")  # the owed file cannot be read: the full tables
    assert window(lost) == (True, -1, 8, 80, "owed rows lost") and lost.owed_token == ""


def test_a_cursor_of_a_newer_generation_is_refused() -> None:
    d = decide_window(WindowAsk("c"), cur(1, generation=4), LOG)
    assert "generation 4, newer than the served 3" in d.refusal


def test_a_single_entry_log() -> None:
    only = LogView(1, ((0, 0),))
    assert window(decide_window(WindowAsk("c"), None, only)) == (True, -1, 0, 0, "no cursor")
    assert window(decide_window(WindowAsk("c"), cur(0, generation=1), only))[0:3] == (
        False,
        0,
        0,
    )


def test_the_request_check() -> None:
    ok = pb.GetDeltaRequest(consumer="c", form=pb.FORM_TOPK, k=5)
    assert check_request("GetDelta", ok) is None
    bad = {
        "consumer": pb.GetDeltaRequest(consumer="a b"),
        "fraction": pb.GetDeltaRequest(consumer="c", fraction=math.nan),
        "FORM_TOPK needs": pb.GetDeltaRequest(consumer="c", form=pb.FORM_TOPK),
        "k and max_rows": pb.GetDeltaRequest(consumer="c", max_rows=1 << 41),
        "row_alignment": pb.GetDeltaRequest(
            consumer="c", dtype=pb.WIRE_DTYPE_PACKED_INT8, row_alignment=3
        ),
    }
    for what, req in bad.items():
        msg = check_request("GetDelta", req)
        assert msg is not None and what in msg, (what, msg)
    assert check_request("GetDelta", pb.GetDeltaRequest(consumer="c", form=99)) is not None
    assert check_request("Register", pb.RegisterRequest(consumer="c")) is None  # default TTL
    assert "lease_ttl" in str(
        check_request("Register", pb.RegisterRequest(consumer="c", lease_ttl_seconds=-1))
    )
    assert check_request("Heartbeat", pb.HeartbeatRequest(consumer="")) is not None
    assert check_request("Status", pb.StatusRequest()) is None
