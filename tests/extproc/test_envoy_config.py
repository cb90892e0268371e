"""extproc.envoy_config's pure parts (the rendered files: tests/integration/test_gateway_config.py)."""
from __future__ import annotations

import re

import pytest

from extproc.envoy_config import decimal_at_most


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 19, 20, 99, 100, 101, 109, 110, 999, 1000, 4096,
                                   70_000, 65536 + (64 << 10), (1 << 20) + (64 << 10)])
def test_decimal_at_most_matches_exactly_one_to_limit(limit):
    """The one-message route's content-length pattern: 1..limit, nothing else (RE2 full
    match, which Python's re.fullmatch agrees with for this syntax)."""
    pattern = re.compile(decimal_at_most(limit))
    around = set(range(0, min(3 * limit, 30_000) + 2))
    around |= {limit - 1, limit, limit + 1, 10 * limit, 10 * limit - 1, 100 * limit + 7}
    for n in around:
        assert bool(pattern.fullmatch(str(n))) == (1 <= n <= limit), n
    for text in (f"0{limit}", "00", "", "-1", f"{limit} ", "1e3", "+1"):
        assert not pattern.fullmatch(text), text


def test_decimal_at_most_refuses_a_limit_below_one():
    with pytest.raises(ValueError):
        decimal_at_most(0)
