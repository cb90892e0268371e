"""Tiny PEFT adapter builders for the pool / op / loader tests (no fixtures needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_agent.engine.peft import BaseModelSpec, LoraAdapter

# GQA-like: k/v narrower than hidden, an MLP module wider than hidden.
SPEC = BaseModelSpec(
    name="tiny-base", num_layers=2, hidden_size=32,
    modules={"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16),
             "o_proj": (32, 32), "up_proj": (32, 80), "down_proj": (80, 32)},
)


def make_adapter(name: str, rank: int, *, spec: BaseModelSpec = SPEC, alpha: float | None = None,
                 modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                 use_rslora: bool = False, seed: int = 0, dtype=torch.float32) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    weights = {}
    for layer in range(spec.num_layers):
        for m in modules:
            fan_in, fan_out = spec.modules[m]
            a = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
            b = (torch.randn(fan_out, rank, generator=g) / rank ** 0.5).to(dtype)
            weights[(layer, m)] = (a, b)
    return LoraAdapter(name=name, rank=rank, alpha=float(alpha if alpha is not None else 2 * rank),
                       target_modules=modules, base_model=spec.name, weights=weights,
                       use_rslora=use_rslora)


def write_peft_dir(root: Path, adapter: LoraAdapter, *, config_overrides: dict | None = None,
                   tensor_overrides: dict | None = None) -> Path:
    """Write ``adapter`` as a PEFT directory ``root/<name>``; return the path."""
    path = Path(root) / adapter.name
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.alpha,
        "target_modules": list(adapter.target_modules),
        "base_model_name_or_path": adapter.base_model, "use_rslora": adapter.use_rslora,
        "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "fan_in_fan_out": False, "bias": "none", "task_type": "CAUSAL_LM",
    }
    cfg.update(config_overrides or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for (layer, m), (a, b) in adapter.weights.items():
        attn = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{attn}.{m}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    tensors.update(tensor_overrides or {})
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def dense_reference(x, w0, rows, adapters, layer, module):
    """x @ (W0 + scale * B @ A)^T row by row, in float64 (on the CPU)."""
    out = []
    for i, name in enumerate(rows):
        w = w0.double().cpu()
        if name is not None:
            ad = adapters[name]
            a, b = ad.weights[(layer, module)]
            w = w + ad.scale * b.double() @ a.double()
        out.append(x[i].double().cpu() @ w.t())
    return torch.stack(out)

