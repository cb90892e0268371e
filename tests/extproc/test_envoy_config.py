"""extproc.envoy_config's pure parts (the rendered files: tests/integration/test_gateway_config.py)."""
from __future__ import annotations

import re

import pytest

import yaml

from extproc.envoy_config import decimal_at_most, render


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


def _extproc_cluster(text: str) -> dict:
    (cluster,) = [c for c in yaml.safe_load(text)["static_resources"]["clusters"] if c["name"] == "ace_extproc"]
    return cluster


def test_render_is_fail_closed_unless_asked():
    def allow(text: str) -> bool:
        config = yaml.safe_load(text)
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        (ext,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        return ext["typed_config"]["failure_mode_allow"]
    assert allow(render()) is False
    assert allow(render(failure_mode_allow=True)) is True


def test_render_puts_every_ext_proc_replica_in_the_cluster():
    one = _extproc_cluster(render(extproc="ace-extproc:50051"))
    three = _extproc_cluster(render(extproc=["127.0.0.1:1", "10.0.0.2:50051", "ace-extproc-b:7"]))
    addresses = lambda c: [(e["endpoint"]["address"]["socket_address"]["address"],
                            e["endpoint"]["address"]["socket_address"]["port_value"])
                           for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses(one) == [("ace-extproc", 50051)]
    assert addresses(three) == [("127.0.0.1", 1), ("10.0.0.2", 50051), ("ace-extproc-b", 7)]
    assert three["health_checks"][0]["grpc_health_check"]["service_name"] == \
        "envoy.service.ext_proc.v3.ExternalProcessor"


@pytest.mark.parametrize("extproc", [[], "nohost", "host:", ":50051", ["127.0.0.1:1", "x:y"]])
def test_render_refuses_a_bad_ext_proc_address(extproc):
    with pytest.raises(ValueError):
        render(extproc=extproc)
