import pytest

from bench.report import (
    build_report,
    by_domain,
    format_report,
    hit_counts,
    percentiles,
    swap_speedup,
    vram_savings_pct,
)


def row(domain="coding", tier="device", wait=0.0, ttft=10.0):
    return {"domain": domain, "adapter": "a", "tier": tier, "wait_ms": wait, "ttft_ms": ttft}


@pytest.mark.parametrize(
    "values, expected",
    [
        ([], {"p50": None, "p90": None, "p95": None, "p99": None}),
        ([5], {"p50": 5, "p90": 5, "p95": 5, "p99": 5}),
        (list(range(1, 101)), {"p50": 50.5, "p90": 90.1, "p95": 95.05, "p99": 99.01}),
        ([3, 1, 2], {"p50": 2, "p90": 2.8, "p95": 2.9, "p99": 2.98}),
    ],
)
def test_percentiles_match_numpy_linear(values, expected):
    got = percentiles(values)
    for k, v in expected.items():
        assert got[k] == (None if v is None else pytest.approx(v))


def test_percentiles_agree_with_numpy():
    np = pytest.importorskip("numpy")
    xs = [0.3, 7, 1, 1, 9.5, 2, 40, 0]
    got = percentiles(xs)
    for q in (50, 90, 95, 99):
        assert got[f"p{q}"] == pytest.approx(float(np.percentile(xs, q)))


def test_hit_counts():
    rows = [row(), row(tier="host", wait=0.5), row(tier="remote", wait=80), row(tier="disk", wait=2)]
    h = hit_counts(rows, stall_eps_ms=1.0)
    assert (h["total"], h["resident_hits"], h["effective_hits"]) == (4, 1, 2)
    assert h["effective_hit_ratio"] == 0.5
    assert hit_counts([])["effective_hit_ratio"] == 0.0


@pytest.mark.parametrize("cold, warm, expected", [(100, 4, 25), (None, 4, None), (100, 0, None), (10, None, None)])
def test_swap_speedup(cold, warm, expected):
    assert swap_speedup(cold, warm) == expected


def test_vram_savings():
    # 10 dedicated instances of a 100-byte base + 10-byte adapter = 1100; shared 100 + pool 50
    assert vram_savings_pct(100, 50, [10] * 10) == pytest.approx(100 * (1 - 150 / 1100))
    assert vram_savings_pct(0, 0, []) == 0.0


def test_by_domain_and_report():
    base = [row("coding", "remote", 50, 70), row("legal", "remote", 100, 120), row("legal", "device", 0, 10)]
    pre = [row("coding", "device", 0, 11), row("legal", "host", 0.2, 12), row("legal", "device", 0, 10)]
    d = by_domain(pre)
    assert list(d) == ["coding", "legal"] and d["legal"]["total"] == 2
    r = build_report(
        base, pre,
        cold_swap_samples_ms=[40, 50, 60], warm_swap_samples_ms=[2, 2, 3],
        base_bytes=1000, pool_bytes=100, adapter_bytes=[10, 20, 30],
        gateway_overhead_ms=1.2,
    )
    assert (r["total"], r["resident_hits"], r["effective_hits"]) == (3, 2, 3)
    assert r["cold_swap_ms"] == 50 and r["warm_swap_ms"] == 2 and r["swap_speedup"] == 25
    assert r["stall_ms"]["baseline"]["p99"] == pytest.approx(99.0)
    assert r["stall_ms"]["prefetch"]["p50"] == 0
    for field in ("ttft_ms", "stall_ms"):
        assert set(r[field]) == {"baseline", "prefetch"}
        assert set(r[field]["prefetch"]) == {"p50", "p90", "p95", "p99"}
    text = format_report(r)
    assert "effective prefetch hits" in text and "legal" in text and "25.0x" in text


def test_unknown_values_print_as_unknown():
    r = build_report([row()], [row()], cold_swap_samples_ms=[], warm_swap_samples_ms=[],
                     base_bytes=1, pool_bytes=1, adapter_bytes=[1], gateway_overhead_ms=None)
    assert r["swap_speedup"] is None
    assert "unknown" in format_report(r)


def test_by_step_splits_first_steps_from_later_ones():
    from bench.report import by_step

    rows = [dict(row("coding", "remote", 12, 20), step=0), dict(row("coding", "device", 0, 5), step=0),
            dict(row("coding", "device", 0, 5), step=1), dict(row("coding", "remote", 9, 15), step=3),
            dict(row("coding", "device", 0, 5), step=2), row("coding", "device", 0, 5)]  # no step: left out
    s = by_step(rows)
    assert (s["first"]["total"], s["first"]["effective_hits"]) == (2, 1)
    assert (s["later"]["total"], s["later"]["effective_hits"]) == (3, 2)
    r = build_report(rows, rows, cold_swap_samples_ms=[12], warm_swap_samples_ms=[1], base_bytes=1,
                     pool_bytes=1, adapter_bytes=[1], gateway_overhead_ms=None)
    assert r["by_step"]["prefetch"]["first"]["total"] == 2
    text = format_report(r)
    assert "session step" in text and "effective hits, prefetch off" in text


def arm(wait, ttft, errors=0, step=None):
    from bench.report import fleet_entry
    rows = [dict(row(tier="device" if w == 0 else "remote", wait=w, ttft=t), step=s)
            for w, t, s in zip(wait, ttft, step or [1] * len(wait))]
    return fleet_entry(rows, errors=errors, requests_per_host={"engine-2": 1, "engine-1": len(rows) - 1},
                       loads_by_tier={"remote": 1}, prefetch={"sent": 3, "used": 2, "wasted": 1, "preempted": None})


def test_fleet_entry_fields_and_arithmetic():
    e = arm([0, 0, 50, 0], [10, 12, 80, 11], step=[0, 1, 0, 2])
    assert (e["total"], e["resident_hits"], e["effective_hits"], e["errors"]) == (4, 3, 3, 0)
    assert e["stall_ms"]["p99"] == pytest.approx(48.5) and set(e["ttft_ms"]) == {"p50", "p90", "p95", "p99"}
    assert e["first_step"] == {"total": 2, "effective_hits": 1}
    assert list(e["requests_per_host"]) == ["engine-1", "engine-2"]
    assert e["prefetch"] == {"sent": 3, "used": 2, "wasted": 1, "preempted": None}


def test_fleet_checks_ace_against_affinity_within_noise_and_targets():
    from bench.report import fleet_checks
    aff = arm([0] * 98 + [40, 40], [10] * 98 + [60, 60])
    ace_good = arm([0] * 100, [10] * 99 + [20])
    c = fleet_checks({"4": {"affinity": aff, "ace": ace_good}})["4"]
    assert c["no_errors"] and c["ace_no_worse_everywhere"]
    assert c["targets"]["effective_hit_ratio"]["met"] and c["targets"]["stall_p99_reduction"]["got"] == float("inf")
    assert c["targets"]["ttft_p99_lower"]["met"]
    # within 1.05x + 1 ms is noise; beyond is worse
    ace_noisy = arm([0] * 100, [10.5] * 98 + [60, 60])
    assert fleet_checks({"2": {"affinity": aff, "ace": ace_noisy}})["2"]["ace_no_worse_everywhere"]
    ace_bad = arm([0] * 100, [12] * 98 + [60, 60], errors=1)
    c = fleet_checks({"2": {"affinity": aff, "ace": ace_bad}})["2"]
    assert c["ace_no_worse_than_affinity"]["ttft_ms"]["p50"] is False and not c["ace_no_worse_everywhere"]
    assert not c["no_errors"] and "targets" not in c


def test_fleet_checks_compare_pooled_replays_where_an_arm_has_them():
    from bench.report import compared, fleet_checks
    aff = arm([0] * 100, [10] * 100)
    ace = arm([0] * 100, [14] * 100)  # its first replay is worse than 1.05x + 1 ms ...
    assert fleet_checks({"2": {"affinity": aff, "ace": ace}})["2"]["ace_no_worse_everywhere"] is False
    pooled = {"replays": 2, "requests": 200, "errors": 1, "effective_hit_ratio": 1.0,
              "stall_ms": aff["stall_ms"], "ttft_ms": dict(aff["ttft_ms"])}
    ace_pooled = {**ace, "pooled": pooled}  # ... the pooled replays are not
    aff_pooled = {**aff, "pooled": {**pooled, "errors": 0}}
    c = fleet_checks({"4": {"affinity": aff_pooled, "ace": ace_pooled}}, scenario="hundreds")["4"]
    assert c["compared"] == "pooled over 2 replays each, palindromic order"
    assert c["ace_no_worse_everywhere"] and c["targets"]["ttft_no_worse"]["met"]
    assert c["errors"] == {"affinity": 0, "ace": 1} and not c["targets"]["no_errors"]["met"]
    assert compared(ace)["ttft_ms"] == ace["ttft_ms"] and compared(ace_pooled)["ttft_ms"] == aff["ttft_ms"]
    assert fleet_checks({"2": {"affinity": aff_pooled, "ace": ace}})["2"]["compared"] == "one replay each"


def test_fleet_checks_hold_ace_below_every_vllm_router_arm_at_every_ttft_percentile():
    from bench.report import fleet_checks
    ace = arm([0] * 100, [10] * 95 + [30] * 5)
    slower = arm([0] * 100, [12] * 95 + [40] * 5)
    tail_only = arm([0] * 100, [9] * 95 + [40] * 5)  # faster at p50, slower at p99
    c = fleet_checks({"4": {"vllm_router": slower, "vllm_router_session": slower, "ace": ace}})["4"]
    assert c["ace_below_every_vllm_router"]
    assert set(c["ace_below_vllm_router"]) == {"vllm_router", "vllm_router_session"}
    c = fleet_checks({"4": {"vllm_router": slower, "vllm_router_session": tail_only, "ace": ace}})["4"]
    assert c["ace_below_vllm_router"]["vllm_router_session"]["p50"] is False
    assert c["ace_below_vllm_router"]["vllm_router_session"]["p99"] is True
    assert not c["ace_below_every_vllm_router"]
    assert "ace_below_vllm_router" not in fleet_checks({"4": {"affinity": ace, "ace": ace}})["4"]


def test_format_fleets_shows_every_arm():
    from bench.report import format_fleets
    text = format_fleets({"1": {"affinity": arm([0, 5], [1, 2]), "ace": arm([0, 0], [1, 1])}}, "prev.json")
    assert "prev.json" in text and "affinity" in text and "ace" in text and "50.00%" in text


def test_by_step_derives_steps_from_session_order_when_the_trace_has_no_step_field():
    from bench.report import by_step

    # rows as the replay records them for a trace without "step" (the field is optional)
    rows = [dict(row("coding", "remote", 12, 20), tenant="a", session="s1", step=None),
            dict(row("coding", "device", 0, 5), tenant="b", session="s1", step=None),   # other tenant: a first step
            dict(row("coding", "device", 0, 5), tenant="a", session="s1", step=None),
            dict(row("coding", "remote", 9, 15), tenant="a", session="s2", step=None),
            dict(row("coding", "device", 0, 5), tenant="a", session="s2", step=None)]
    s = by_step(rows)
    assert (s["first"]["total"], s["first"]["effective_hits"]) == (3, 1)
    assert (s["later"]["total"], s["later"]["effective_hits"]) == (2, 2)


def test_rows_recorded_before_the_tier_rename_count_as_resident():
    # reports/ keeps rows whose engine header said "pool" for the device tier
    counts = hit_counts([row(tier="device"), row(tier="pool"), row(tier="host", wait=0.3)])
    assert counts["resident_hits"] == 2


def test_sixteen_targets():
    from bench.report import sixteen_targets

    pct = {"p50": 1.0, "p90": 2.0, "p95": 3.0, "p99": 4.0}
    aff = {"effective_hit_ratio": 0.98, "stall_ms": pct, "ttft_ms": pct, "errors": 0}
    ace = {**aff, "effective_hit_ratio": 0.99, "bounds": {"fleet_compulsory_hit_ratio": 0.9867}}
    t = sixteen_targets(ace, aff)
    assert t["effective_hit_ratio"]["met"] and t["ttft_ms_no_worse"]["met"] and t["no_errors"]["met"]
    assert t["effective_hit_ratio"]["ceiling"] == 0.9867
    worse = sixteen_targets({**ace, "ttft_ms": {**pct, "p99": 40.0}}, aff)
    assert not worse["ttft_ms_no_worse"]["met"]


def test_first_replay_rows_are_the_rows_the_entries_come_from(tmp_path):
    import json
    from bench.report import first_replay_rows
    rows = [{"arm": "ace", "id": "a"}, {"arm": "ace", "id": "b", "replay": 1}, {"arm": "ace", "id": "c", "replay": 2}]
    (tmp_path / "r_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert [r["id"] for r in first_replay_rows(tmp_path / "r.json")] == ["a", "b"]


def test_machine_pace_reads_the_probe_per_run_and_falls_back_to_the_client():
    from bench.report import fleet_checks, machine_pace
    aff = {**arm([0] * 10, [10] * 10), "process_cpu_s": {"client": 16.0, "envoy": 5.0},
           "pace_probe_ms": {"samples": 300, "cpu_ms_p50": 2.0}}
    ace = {**arm([0] * 10, [12] * 10), "process_cpu_s": {"client": 20.0},
           "pace_probe_ms": {"samples": 300, "cpu_ms_p50": 2.5},
           "pooled": {"replays": 2, "errors": 0, "client_cpu_s": [20.0, 24.0], "pace_probe_ms": [2.5, 3.0]}}
    ace["pooled"].update(stall_ms=ace["stall_ms"], ttft_ms=ace["ttft_ms"])
    pace = machine_pace({"affinity": aff, "ace": ace})
    assert pace["measure"].startswith("CPU time of bench.pace")
    assert pace["runs"] == {"affinity": [1.0], "ace": [1.25, 1.5]}
    assert pace["ace_over_affinity"] == pytest.approx(1.375)   # mean 2.75 over 2.0: the machine was slower
    assert fleet_checks({"4": {"affinity": aff, "ace": ace}})["4"]["machine_pace"] == pace
    # a report from before the probe: the load generator's CPU seconds, as a hint
    old = machine_pace({"affinity": {**aff, "pace_probe_ms": None},
                        "ace": {**ace, "pooled": {**ace["pooled"], "pace_probe_ms": [None, None]}}})
    assert old["measure"].startswith("load generator CPU seconds") and old["runs"]["ace"] == [1.25, 1.5]
    unmeasured = arm([0], [1])
    assert machine_pace({"affinity": unmeasured, "ace": unmeasured}) is None
    assert "machine_pace" not in fleet_checks({"1": {"affinity": unmeasured}})["1"]
    assert "ace_over_affinity" not in machine_pace({"affinity": aff})
