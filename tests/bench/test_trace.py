import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.trace import TraceError, load_trace

ROOT = Path(__file__).resolve().parents[2]
EVAL = ROOT / "data/multi_lora_eval/multi_lora_eval_800.json"
FIXTURE_ADAPTERS = {
    "code-python": 8, "code-sql": 32, "med-triage": 16, "med-notes": 64, "legal-contracts": 32,
    "legal-review": 128, "fin-reports": 8, "fin-risk": 64, "tr-de-en": 16, "tr-fr-en": 128,
}


def req(**over):
    r = {"t": 0.5, "tenant": "acme", "adapter": "code-sql", "rank": 32, "domain": "coding",
         "session": "s1", "messages": [{"role": "user", "content": "hi"}]}
    r.update(over)
    return r


def test_committed_eval_trace_matches_the_issue():
    reqs = load_trace(EVAL)
    assert len(reqs) == 800
    assert {r["domain"] for r in reqs} == {"coding", "medical", "legal", "finance", "translation"}
    assert len({r["tenant"] for r in reqs}) == 8
    assert {r["adapter"]: r["rank"] for r in reqs} == FIXTURE_ADAPTERS
    sessions = {}
    for r in reqs:
        sessions.setdefault(r["session"], []).append(r["adapter"])
    assert sum(1 for s in sessions.values() if len(set(s)) >= 3) > 20  # multi-step workflows
    assert [r["t"] for r in reqs] == sorted(r["t"] for r in reqs)


def test_generator_is_deterministic_and_matches_committed_file(tmp_path):
    out = tmp_path / "again.json"
    subprocess.run([sys.executable, str(ROOT / "data/multi_lora_eval/generate.py"), "--out", str(out)],
                   check=True, capture_output=True)
    assert out.read_bytes() == EVAL.read_bytes()


def test_jsonl_is_accepted(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(req(t=2)) + "\n\n" + json.dumps(req(t=1)) + "\n")
    assert [r["t"] for r in load_trace(p)] == [1, 2]


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"t": 1}, "missing field(s) 'tenant'"),
        (req(t=-1), "'t' must be a non-negative number"),
        (req(t="soon"), "'t' must be a non-negative number"),
        (req(rank=0), "'rank' must be a positive integer"),
        (req(rank=True), "'rank' must be a positive integer"),
        (req(tenant=""), "'tenant' must be a non-empty string"),
        (req(messages=[]), "'messages' must be a non-empty list"),
        (req(messages=[{"role": "user"}]), "messages[0] must be an object"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_invalid_requests_name_the_field(tmp_path, obj, message):
    p = tmp_path / "t.json"
    p.write_text(json.dumps([req(), obj]))
    with pytest.raises(TraceError) as err:
        load_trace(p)
    assert message in str(err.value) and "request [1]" in str(err.value)


def test_errors_for_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(req()) + "\n{nope\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2: invalid JSON Lines"):
        load_trace(bad)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.json")
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps([req(), req(rank=8)]))
    with pytest.raises(TraceError, match="has rank 8 here but 32"):
        load_trace(clash)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(empty)
