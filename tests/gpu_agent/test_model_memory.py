"""Memory accounting from real tensor sizes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_agent.fixtures import ADAPTERS, make_fixtures
from gpu_agent.engine.memory import account, model_dir_bytes, safetensors_bytes

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fx")
    make_fixtures(out)
    return out


def test_sizes_come_from_the_tensors(fx):
    from gpu_agent.engine.model import LlamaModel
    from gpu_agent.engine.peft import BaseModelSpec, load_peft_dir

    model = LlamaModel.from_dir(fx / "model")
    assert model_dir_bytes(fx / "model") == model.nbytes
    spec = BaseModelSpec("ace-tiny-llama", 2, 128, model.cfg.module_shapes())
    ad = load_peft_dir(fx / "adapters/tr-fr-en", spec)
    assert safetensors_bytes(fx / "adapters/tr-fr-en/adapter_model.safetensors") == ad.nbytes


def test_shared_base_plus_pool_vs_dedicated_instances(fx):
    base = model_dir_bytes(fx / "model")
    sizes = {a.name: safetensors_bytes(fx / "adapters" / a.name / "adapter_model.safetensors") for a in ADAPTERS}
    pool = 8 << 20
    acc = account(base, pool, sizes)
    assert acc.dedicated_instances == len(ADAPTERS)
    assert acc.dedicated_bytes == len(ADAPTERS) * base + sum(sizes.values())
    assert acc.shared_bytes == base + pool
    assert acc.pool_fits_all and acc.saving_ratio == pytest.approx(acc.dedicated_bytes / acc.shared_bytes)
    few = account(base, pool, sizes, n_instances=2)
    assert few.dedicated_bytes == 2 * base + sum(sorted(sizes.values())[-2:])


def test_engine_reports_its_memory(fx):
    from gpu_agent.engine import Engine, EngineSettings

    eng = Engine.create(EngineSettings(catalog=fx / "catalog.yaml", pool_bytes=4 << 20))
    acc = eng.memory()
    assert acc.base_model_bytes == model_dir_bytes(fx / "model")
    assert acc.pool_bytes == eng.pool.stats()["pool_bytes"] <= 4 << 20
    assert acc.adapters == len(ADAPTERS)
