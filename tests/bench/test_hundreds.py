"""The hundreds scenario: its generator, the committed trace, and the adapters the bench makes for it."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from bench.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ROOT / "data/multi_lora_eval/generate.py"
COMMITTED = ROOT / "data/multi_lora_eval/hundreds.json"


def generate(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "trace.json"
    subprocess.run([sys.executable, str(GENERATE), "--scenario", "hundreds", *args, "--out", str(out)],
                   check=True, capture_output=True)
    return out


def test_committed_hundreds_trace_is_the_generator_output(tmp_path):
    assert generate(tmp_path).read_bytes() == COMMITTED.read_bytes()


@pytest.mark.parametrize("seed", [None, "20261202", "20261203"])
def test_hundreds_has_the_mission_shape(tmp_path, seed):
    reqs = load_trace(COMMITTED if seed is None else generate(tmp_path, "--seed", seed))
    ranks = {r["adapter"]: r["rank"] for r in reqs}
    assert len(reqs) == 2400
    assert len(ranks) >= 200
    assert set(ranks.values()) == {8, 16, 32, 64, 128}
    sessions: dict[tuple, list[dict]] = defaultdict(list)
    for r in reqs:
        sessions[(r["tenant"], r["session"])].append(r)
    # at least 40 tenants run multi-step workflows
    assert len({t for (t, _), steps in sessions.items() if len(steps) >= 4}) >= 40
    # each tenant sends only public adapters and its own (tNN-... belongs to tNN-<domain>)
    for r in reqs:
        assert r["adapter"].startswith("pub-") or r["adapter"].split("-")[0] == r["tenant"].split("-")[0]
    # one-off sessions, and strays: a step to an adapter its session's workflow does not name
    assert sum(1 for r in reqs if r["workflow"] == "one-off") >= 20
    assert sum(1 for r in reqs if r["workflow"] != "one-off" and r["adapter"] not in r["workflow"].split("->")) >= 20
    # Zipf activity: the busiest tenant sends many times the median tenant's requests
    counts = sorted(Counter(r["tenant"] for r in reqs).values())
    assert counts[-1] >= 5 * counts[len(counts) // 2]


def test_held_out_seeds_differ_from_the_committed_world(tmp_path):
    held = load_trace(generate(tmp_path, "--seed", "20261202"))
    committed = load_trace(COMMITTED)
    assert {r["workflow"] for r in held}.isdisjoint({r["workflow"] for r in committed} - {"one-off"})


def test_800_only_options_are_refused_for_the_800_scenario(tmp_path):
    res = subprocess.run([sys.executable, str(GENERATE), "--tenants", "3", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "--scenario hundreds" in res.stderr


def test_trace_catalog_makes_missing_adapters_once(tmp_path, tmp_path_factory):
    pytest.importorskip("torch")
    from bench.scenario_fixtures import trace_catalog
    from ace_common.catalog_schema import read_catalog_file
    from tests.support.fixtures import fixtures_dir

    fixtures = fixtures_dir(tmp_path_factory)
    reqs = [{"adapter": "pub-x-00", "rank": 8, "domain": "x"}, {"adapter": "t01-y-0", "rank": 16, "domain": "y"}]
    cat = trace_catalog(reqs, fixtures, tmp_path / "cache")
    assert {(a.name, a.rank) for a in read_catalog_file(cat).adapters} == {("pub-x-00", 8), ("t01-y-0", 16)}
    assert (cat.parent / "adapters/t01-y-0/adapter_model.safetensors").stat().st_size > 0
    stamp = cat.stat().st_mtime_ns
    assert trace_catalog(list(reversed(reqs)), fixtures, tmp_path / "cache") == cat
    assert cat.stat().st_mtime_ns == stamp
    # the same names at other ranks are other adapters
    assert trace_catalog([dict(reqs[0], rank=32)], fixtures, tmp_path / "cache") != cat
    # a trace over the committed adapters uses the committed catalog
    committed = load_trace(ROOT / "data/multi_lora_eval/multi_lora_eval_800.json")
    assert trace_catalog(committed, fixtures, tmp_path / "cache") == fixtures / "catalog.yaml"


SIXTEEN = ROOT / "data/multi_lora_eval/sixteen.json"
VLLM_TRACE = ROOT / "data/multi_lora_eval/vllm_hosts.json"


@pytest.mark.parametrize("scenario, committed", [("sixteen", SIXTEEN), ("vllm", VLLM_TRACE)])
def test_committed_scenario_trace_is_the_generator_output(tmp_path, scenario, committed):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(GENERATE), "--scenario", scenario, "--out", str(out)], check=True,
                   capture_output=True)
    assert out.read_bytes() == committed.read_bytes()


def test_sixteen_has_its_shape():
    reqs = load_trace(SIXTEEN)
    assert len(reqs) == 1200
    assert len({r["adapter"] for r in reqs}) == 16
    assert len({r["tenant"] for r in reqs}) == 12
    assert set({r["adapter"]: r["rank"] for r in reqs}.values()) <= {8, 16, 32, 64, 128}
    assert sum(1 for r in reqs if r["workflow"] == "one-off") >= 10



def test_vllm_trace_exceeds_two_hosts_caches_threefold():
    """Issue 20's shape: two hosts of 4 CPU-cache entries hold a third of the catalog, and
    sessions run habitual workflows (several steps, several adapters each)."""
    reqs = load_trace(VLLM_TRACE)
    assert len(reqs) == 240
    adapters = {r["adapter"] for r in reqs}
    assert len(adapters) >= 3 * 2 * 4
    assert set({r["adapter"]: r["rank"] for r in reqs}.values()) <= {8, 16, 32, 64, 128}
    by_session: dict[str, set] = {}
    for r in reqs:
        by_session.setdefault(r["session"], set()).add(r["adapter"])
    assert sum(1 for s in by_session.values() if len(s) >= 2) >= len(by_session) // 3
