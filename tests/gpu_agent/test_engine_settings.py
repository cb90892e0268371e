"""The builtin engine's command line: the staging buffers' size (CUDA pools) is a setting."""
from __future__ import annotations

import pytest

from gpu_agent.engine.__main__ import parse_args
from gpu_agent.engine.core import EngineSettings
from gpu_agent.engine.pool_copy import STAGING_MIN_SLOT_BYTES, STAGING_SLOT_BYTES, STAGING_SLOTS


def test_staging_bytes_defaults_to_the_pools_buffers_and_is_read_from_the_flag(tmp_path):
    settings, _, _ = parse_args(["--catalog", str(tmp_path / "catalog.yaml")])
    assert settings.staging_bytes == STAGING_SLOTS * STAGING_SLOT_BYTES == 64 << 20
    settings, _, _ = parse_args(["--catalog", str(tmp_path / "catalog.yaml"), "--staging-bytes", str(8 << 20)])
    assert settings.staging_bytes == 8 << 20


@pytest.mark.parametrize("size", [0, -1, STAGING_SLOTS * STAGING_MIN_SLOT_BYTES - 1])
def test_staging_bytes_too_small_for_its_buffers_is_refused_with_the_floor(tmp_path, capsys, size):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--catalog", str(tmp_path / "catalog.yaml"), "--staging-bytes", str(size)])
    assert exc.value.code == 2
    assert f"staging_bytes must be >= {STAGING_SLOTS * STAGING_MIN_SLOT_BYTES}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="staging_bytes"):
        EngineSettings(catalog=tmp_path / "c.yaml", staging_bytes=size).validate()


def test_a_cpu_pool_takes_no_staging_buffers():
    from gpu_agent.engine.pool import AdapterPool

    from .lora_testing import SPEC

    assert AdapterPool(SPEC, 1 << 20, staging_bytes=8 << 20).staging is None
