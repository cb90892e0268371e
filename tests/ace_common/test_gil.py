"""The GIL switch interval both entry points set (``--gil-switch-ms``)."""
from __future__ import annotations

import sys

import pytest

from ace_common.gil import set_switch_interval


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_milliseconds_become_the_interpreters_switch_interval(restore_interval):
    set_switch_interval(0.5)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_zero_leaves_the_interval_as_it_was(restore_interval):
    sys.setswitchinterval(0.003)
    set_switch_interval(0)
    assert sys.getswitchinterval() == pytest.approx(0.003)
