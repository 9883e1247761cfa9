"""Leases (prefill side) and read deadlines (decode side): pure Python, explicit clocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopserve.kv_transfer.leases import ReceiveTracker, TransferLedger


def test_unrenewed_lease_expires_exactly_at_its_deadline_and_only_once():
    led = TransferLedger(lease_s=2.0)
    led.add("a", 10.0)
    led.add("b", 11.0)
    assert led.expired(11.99) == [] and led.deadline("a") == 12.0
    assert led.expired(12.0) == ["a"] and "a" not in led and len(led) == 1
    assert led.expired(100.0) == ["b"] and led.expired(200.0) == []
    assert not led.done("a")  # already freed by expiry: a late READ notification is ignored


@settings(max_examples=60, deadline=None)
@given(lease=st.floats(0.5, 5.0), gaps=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=80))
def test_a_renewed_lease_never_expires(lease, gaps):
    """A reader that renews within every lease period keeps the blocks, however long it lags."""
    led = TransferLedger(lease_s=lease)
    led.add("slow", 0.0)
    now = 0.0
    for g in gaps:
        now += g * lease
        assert led.renew(["slow"], now) == []
        assert led.expired(now + lease * 0.999) == []  # checked just before the renewed deadline
    assert "slow" in led
    assert led.expired(now + lease) == ["slow"]  # renewals stopped: freed one lease later


def test_done_frees_the_lease_and_renew_reports_ids_not_held():
    led = TransferLedger(lease_s=1.0)
    led.add("a", 0.0)
    assert led.done("a") and not led.done("a")
    assert led.renew(["a", "zz"], 0.5) == ["a", "zz"] and len(led) == 0
    led.add("a", 1.0)  # the id may be reused once freed
    with pytest.raises(ValueError, match="'a' is already tracked"):
        led.add("a", 1.0)


def test_receive_tracker_bounds_every_wait():
    tr = ReceiveTracker(timeout_s=3.0)
    tr.start("x", 0.0)
    tr.start("y", 1.0)
    assert tr.expired(2.9) == [] and tr.pending() == ["x", "y"]
    assert tr.done("y") and tr.expired(3.0) == ["x"] and len(tr) == 0


@pytest.mark.parametrize("cls", [TransferLedger, ReceiveTracker])
@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_non_positive_timeouts_are_refused(cls, bad):
    with pytest.raises(ValueError, match=f"{cls.__name__} timeout must be > 0 seconds, got {bad}"):
        cls(bad)
