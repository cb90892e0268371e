"""The agent's settings: defaults, what 0 means for the tier budgets, validation."""
from __future__ import annotations

import pytest

from gpu_agent.settings import AgentSettings, SettingsError, parse_args


@pytest.fixture
def catalog(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text("base_model: {name: m}\nadapters: []\n")
    return path


def help_of(name: str) -> str:
    return AgentSettings.__dataclass_fields__[name].metadata["help"]


def test_production_defaults_keep_warm_tiers(catalog):
    s = parse_args(["--catalog", str(catalog), "--auth", "none"])
    assert (s.disk_budget_mb, s.engine_host_mb, s.host_budget_mb, s.pool_mb) == (4096, 512, 0, 64)


def test_zero_budgets_are_documented_and_accepted(catalog):
    assert "0 = resident-only" in help_of("disk_budget_mb")
    assert "0 = none" in help_of("engine_host_mb")
    s = parse_args(["--catalog", str(catalog), "--auth", "none", "--disk-budget-mb", "0", "--engine-host-mb", "0"])
    assert s.disk_budget_mb == 0 and s.engine_host_mb == 0


@pytest.mark.parametrize("flag", ["--disk-budget-mb", "--engine-host-mb", "--host-budget-mb", "--device-budget-mb"])
def test_negative_budgets_are_refused(catalog, flag):
    with pytest.raises(SettingsError, match=flag):
        parse_args(["--catalog", str(catalog), "--auth", "none", flag, "-1"])


def test_pool_needs_a_mib(catalog):
    with pytest.raises(SettingsError, match="--pool-mb"):
        parse_args(["--catalog", str(catalog), "--auth", "none", "--pool-mb", "0"])


def test_load_interval_defaults_accepts_off_and_refuses_out_of_range(catalog):
    base = ["--catalog", str(catalog), "--auth", "none"]
    assert parse_args(base).load_interval_s == 0.5
    assert parse_args(base + ["--load-interval-s", "0"]).load_interval_s == 0
    assert "0 = off" in help_of("load_interval_s")
    for bad in ("-0.1", "2.5", "nan"):
        with pytest.raises(SettingsError, match="--load-interval-s"):
            parse_args(base + ["--load-interval-s", bad])


def test_a_vllm_resolver_is_a_switch_off_by_default(catalog):
    """--vllm-resolver: vLLM registers a request's unknown adapter itself, so the agent
    leaves that load to it; off by default (nothing else would make it)."""
    base = ["--catalog", str(catalog), "--auth", "none", "--engine", "vllm", "--engine-url", "http://127.0.0.1:1"]
    assert parse_args(base).vllm_resolver is False
    assert parse_args([*base, "--vllm-resolver"]).vllm_resolver is True
    assert parse_args([*base, "--vllm-resolver", "--no-vllm-resolver"]).vllm_resolver is False
    with pytest.raises(SystemExit):
        parse_args([*base, "--vllm-resolver", "yes"])


def test_vllms_evicting_unload_is_a_switch_off_by_default(catalog):
    """--vllm-unload-evicts: only with ace's evicting plugin in vLLM (an unload then drops
    the weights from its CPU cache); off by default, where an unload only forgets a name."""
    base = ["--catalog", str(catalog), "--auth", "none", "--engine", "vllm", "--engine-url", "http://127.0.0.1:1"]
    assert parse_args(base).vllm_unload_evicts is False
    assert parse_args([*base, "--vllm-unload-evicts"]).vllm_unload_evicts is True
    assert parse_args([*base, "--vllm-unload-evicts", "--no-vllm-unload-evicts"]).vllm_unload_evicts is False


def test_the_builtin_engines_compute_defer_is_the_agents_flag_with_the_engines_default(catalog):
    """--prefetch-compute-defer-ms reaches the in-process engine; its default is the
    engine's own, 0 turns the wait off, and a negative or NaN value is refused."""
    from gpu_agent.__main__ import builtin_engine_settings
    from gpu_agent.engine.core import EngineSettings

    base = ["--catalog", str(catalog), "--auth", "none"]
    default = EngineSettings.__dataclass_fields__["prefetch_compute_defer_ms"].default
    assert parse_args(base).prefetch_compute_defer_ms == default
    assert builtin_engine_settings(parse_args(base + ["--prefetch-compute-defer-ms", "0"])).prefetch_compute_defer_ms == 0
    assert builtin_engine_settings(parse_args(base + ["--prefetch-compute-defer-ms", "250"])).prefetch_compute_defer_ms == 250
    for bad in ("-1", "nan"):
        with pytest.raises(SettingsError, match="--prefetch-compute-defer-ms"):
            parse_args(base + ["--prefetch-compute-defer-ms", bad])


def test_the_builtin_engines_node_wait_is_the_agents_flag_on_by_default(catalog):
    from gpu_agent.__main__ import builtin_engine_settings
    from gpu_agent.engine.core import EngineSettings

    base = ["--catalog", str(catalog), "--auth", "none"]
    assert EngineSettings.__dataclass_fields__["prefetch_node_cpu"].default is True
    assert builtin_engine_settings(parse_args(base)).prefetch_node_cpu is True
    assert builtin_engine_settings(parse_args(base + ["--no-prefetch-node-cpu"])).prefetch_node_cpu is False


def test_the_gil_switch_interval_defaults_to_half_a_millisecond_and_0_is_pythons(catalog):
    base = ["--catalog", str(catalog), "--auth", "none"]
    assert parse_args(base).gil_switch_ms == 0.5
    assert parse_args(base + ["--gil-switch-ms", "0"]).gil_switch_ms == 0
    for bad in ("-1", "101", "nan"):
        with pytest.raises(SettingsError, match="--gil-switch-ms"):
            parse_args(base + ["--gil-switch-ms", bad])
