"""bench.vllm_paths on a real vLLM: each case is the path it names (vLLM's log says so, or
the run fails), and the fronts are timed against a direct request. No timing is asserted."""
from __future__ import annotations

import json

import pytest

from bench import vllm_paths
from tests.support.fixtures import fixtures_dir
from tests.support.vllm import vllm_python

pytestmark = pytest.mark.vllm

#: eight adapters acme may use (its own two and the public ones): the cases need CYCLE + 2
ADAPTERS = {"code-python": 8, "code-sql": 32, "legal-contracts": 32, "legal-review": 128, "fin-reports": 8,
            "fin-risk": 64, "tr-de-en": 16, "tr-fr-en": 128}


def test_paths_and_fronts_on_real_vllm(tmp_path, tmp_path_factory):
    py = vllm_python()
    fixtures = fixtures_dir(tmp_path_factory)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([
        {"id": f"req-{i:04d}", "t": float(i), "tenant": "acme", "session": f"s{i}", "step": 0, "adapter": name,
         "rank": rank, "domain": "test", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
        for i, (name, rank) in enumerate(ADAPTERS.items())]))
    out = tmp_path / "paths.json"
    assert vllm_paths.main(["--trace", str(trace), "--n", "6", "--fronts", "envoy", "--vllm-python", py,
                            "--fixtures", str(fixtures), "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {c: report["cases"][c]["requests"] for c in vllm_paths.CASES} == dict.fromkeys(vllm_paths.CASES, 6)
    assert set(report["front"]) == {"gateway", "envoy", "direct"}
    assert all(v["requests"] == 6 for v in report["front"].values())
    assert set(report["front_paired_ms"]) == {"gateway_minus_direct", "gateway_minus_envoy", "envoy_minus_direct"}


def test_unknown_front_is_refused():
    with pytest.raises(SystemExit):
        vllm_paths.main(["--fronts", "nginx"])
