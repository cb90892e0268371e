"""Admission (load shedding) and the fallback order are policy, not protocol (issue 19):
pure functions over a snapshot, tested without a stream."""
from __future__ import annotations

import pytest

from extproc.errors import TooManyRequests
from extproc.policy.admission import admit
from extproc.policy.routing import eligible_upstreams, pick_order
from extproc.state.catalog import Upstream
from extproc.state.residency import ResidencySnapshot, SentCounts


def _ups(*names: str) -> list[Upstream]:
    return [Upstream(name=n, address=f"10.0.0.{i + 1}:8000", flavour="vllm", base_model="m", hints="body")
            for i, n in enumerate(names)]


def test_admit_sheds_only_when_every_eligible_host_is_at_the_bound():
    ups, sent = _ups("a", "b"), SentCounts()
    admit(ups, ResidencySnapshot.build({}, loads={"a": 9, "b": 9}), sent, 0)       # 0: never
    admit(ups, ResidencySnapshot.build({}, loads={"a": 9, "b": 2}), sent, 3)       # b has room
    admit(ups, ResidencySnapshot.build({}, loads={"a": 9}), sent, 3)               # b unknown: 0
    with pytest.raises(TooManyRequests, match="3 or more"):
        admit(ups, ResidencySnapshot.build({}, loads={"a": 3, "b": 4}), sent, 3)


def test_pick_order_puts_the_decision_first_then_the_policy_s_order():
    ups = _ups("a", "b", "c")
    last = lambda cands, adapter, res, sent: cands[-1]   # noqa: E731 - a policy ranking from the end
    res, sent = ResidencySnapshot(), SentCounts()
    assert [u.name for u in pick_order(last, ups, ups[0], None, res, sent, 3)] == ["a", "c", "b"]
    assert [u.name for u in pick_order(last, ups, None, None, res, sent, 2)] == ["c", "b"]
    outside = lambda cands, adapter, res, sent: _ups("z")[0]   # noqa: E731 - answers outside the list
    assert [u.name for u in pick_order(outside, ups, None, None, res, sent, 2)] == ["a", "b"]


def test_eligible_upstreams_reads_the_subset_hint():
    ups = _ups("a", "b")
    assert eligible_upstreams(ups, None) == ups
    assert eligible_upstreams(ups, ("10.0.0.2:8000",)) == [ups[1]]
    assert eligible_upstreams(ups, ("10.0.0.1",)) == [ups[0]]
    assert eligible_upstreams(ups, ("10.9.9.9:1",)) == []
