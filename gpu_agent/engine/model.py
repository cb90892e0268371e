"""A Llama forward pass in plain torch, with a LoRA hook on every attention projection.

One call of :meth:`LlamaModel.forward` runs one *step* for a batch of sequences: each
sequence contributes its new tokens (a whole prompt for a prefill, one token for a
decode), all rows are flattened into one ``[N, hidden]`` matrix, and every linear layer
runs once over all rows, so rows of different sequences with different adapters share
each matmul. Only attention is per sequence (each has its own KV cache length).

After each q/k/v/o projection the hook is called as ``lora(y, x, layer, module)`` and
adds the LoRA delta in place: ``y[i] += scale[a] * (x[i] @ A[a]^T) @ B[a]^T`` with
``a`` the adapter of row ``i`` (the engine binds it to ``lora_ops.apply_lora``).

Naming and maths follow Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotate-half RoPE,
grouped-query attention, SwiGLU), so a checkpoint from the fixtures or a real small
Llama loads as is.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:  # torch stays a lazy import for modules the gateway may touch
    import torch

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LoraHook = Callable[["torch.Tensor", "torch.Tensor", int, str], None]


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        if cfg.get("model_type", "llama") not in ("llama", "mistral") and "LlamaForCausalLM" not in arch:
            raise ValueError(f"not a Llama checkpoint: model_type={cfg.get('model_type')!r}")
        if cfg.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported by the builtin engine")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """LoRA-targetable projections: ``module -> (in_features, out_features)``."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, list) else (int(e),)


class KVCache:
    """Keys and values of one sequence, preallocated to ``capacity`` positions."""

    def __init__(self, cfg: LlamaConfig, capacity: int, device: Any, dtype: Any):
        import torch

        shape = (capacity, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.capacity = capacity
        self.length = 0  # positions filled (committed after a whole step)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class SequenceStep:
    """One sequence's part of a forward: its new token ids and its cache."""

    tokens: Sequence[int]
    cache: KVCache


class LlamaModel:
    """Weights under HF names plus the forward. Stateless apart from the weights."""

    def __init__(self, cfg: LlamaConfig, weights: Mapping[str, "torch.Tensor"], *,
                 device: Any = "cpu", dtype: Any = None):
        import torch

        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype or torch.float32
        self.w = {k: v.to(device=self.device, dtype=self.dtype) for k, v in weights.items()}
        if cfg.tie_word_embeddings and "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        missing = [k for k in self.expected_keys() if k not in self.w]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        half = cfg.head_dim // 2
        self._inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, half, device=self.device, dtype=torch.float32) * 2 / cfg.head_dim))

    @classmethod
    def from_dir(cls, path: str | Path, *, device: Any = "cpu", dtype: Any = None) -> "LlamaModel":
        from safetensors.torch import load_file

        p = Path(path)
        cfg = LlamaConfig.from_hf(json.loads((p / "config.json").read_text()))
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{p}: no *.safetensors checkpoint")
        weights: dict[str, Any] = {}
        for f in files:
            weights.update(load_file(str(f)))
        return cls(cfg, weights, device=device, dtype=dtype)

    def expected_keys(self) -> list[str]:
        keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}"
            keys += [f"{p}.self_attn.{m}.weight" for m in ATTN_MODULES]
            keys += [f"{p}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
            keys += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        return keys

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.w.values():
            if t.data_ptr() not in seen:  # a tied lm_head counts once
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.cfg, capacity, self.device, self.dtype)

    # -- forward -------------------------------------------------------------------

    def _rms(self, x, weight):
        import torch

        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x, positions):
        # HF rotate-half convention: the two halves of each head form the complex pairs.
        import torch

        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, steps: Sequence[SequenceStep], lora: LoraHook | None = None):
        """Run one step; returns the logits of each sequence's last new token ``[S, vocab]``.

        Caches are written at positions ``cache.length ...`` and their lengths advanced.
        """
        import torch
        import torch.nn.functional as F

        cfg, w = self.cfg, self.w
        if not steps:
            raise ValueError("forward needs at least one sequence")
        lens, starts = [], []
        for s in steps:
            n = len(s.tokens)
            if n == 0:
                raise ValueError("every sequence in a step needs at least one new token")
            if s.cache.length + n > s.cache.capacity:
                raise ValueError(f"sequence exceeds its cache ({s.cache.length}+{n} > {s.cache.capacity})")
            lens.append(n)
            starts.append(s.cache.length)
        ids = torch.tensor([t for s in steps for t in s.tokens], device=self.device, dtype=torch.long)
        positions = torch.cat([torch.arange(st, st + n, device=self.device) for st, n in zip(starts, lens)])
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = nh // nkv
        x = F.embedding(ids, w["model.embed_tokens.weight"])
        with torch.no_grad():
            for layer in range(cfg.num_layers):
                p = f"model.layers.{layer}"
                h = self._rms(x, w[f"{p}.input_layernorm.weight"])
                qkv = []
                for m in ("q_proj", "k_proj", "v_proj"):
                    y = h @ w[f"{p}.self_attn.{m}.weight"].T
                    if lora is not None:
                        lora(y, h, layer, m)
                    qkv.append(y)
                q = self._rope(qkv[0].view(-1, nh, hd), positions)
                k = self._rope(qkv[1].view(-1, nkv, hd), positions)
                v = qkv[2].view(-1, nkv, hd)
                attn = torch.empty_like(q)
                row = 0
                for s, st, n in zip(steps, starts, lens):
                    c = s.cache
                    c.k[layer][st:st + n] = k[row:row + n]
                    c.v[layer][st:st + n] = v[row:row + n]
                    kk = c.k[layer][:st + n].transpose(0, 1)  # [nkv, L, hd]
                    vv = c.v[layer][:st + n].transpose(0, 1)
                    if group > 1:
                        kk = kk.repeat_interleave(group, dim=0)
                        vv = vv.repeat_interleave(group, dim=0)
                    qq = q[row:row + n].transpose(0, 1)  # [nh, n, hd]
                    mask = None
                    if n > 1:  # query j sits at position st+j and sees keys 0..st+j
                        mask = (torch.arange(st + n, device=self.device)[None, :]
                                <= (st + torch.arange(n, device=self.device))[:, None])
                    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                         scale=1.0 / math.sqrt(hd))
                    attn[row:row + n] = out.transpose(0, 1)
                    row += n
                a = attn.reshape(-1, nh * hd)
                o = a @ w[f"{p}.self_attn.o_proj.weight"].T
                if lora is not None:
                    lora(o, a, layer, "o_proj")
                x = x + o
                h = self._rms(x, w[f"{p}.post_attention_layernorm.weight"])
                gate = h @ w[f"{p}.mlp.gate_proj.weight"].T
                up = h @ w[f"{p}.mlp.up_proj.weight"].T
                x = x + (F.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T
            last = torch.tensor([sum(lens[:i + 1]) - 1 for i in range(len(lens))], device=self.device)
            hl = self._rms(x[last], w["model.norm.weight"])
            logits = (hl @ w["lm_head.weight"].T).float()
        for s, n in zip(steps, lens):
            s.cache.length += n
        return logits


def merge_adapter(model: LlamaModel, adapter: Any) -> LlamaModel:
    """A copy of ``model`` with ``W = W0 + scale * B @ A`` folded into each adapted projection.

    ``adapter`` is a ``peft.LoraAdapter`` (or anything with ``scale`` and
    ``weights[(layer, module)] = (A [r, in], B [out, r])``). The reference path the
    batched LoRA op is compared against.
    """
    weights = dict(model.w)
    for (layer, module), (a, b) in adapter.weights.items():
        key = f"model.layers.{layer}.self_attn.{module}.weight"
        w0 = weights[key]
        delta = (b.to(device=w0.device, dtype=w0.dtype) @ a.to(device=w0.device, dtype=w0.dtype))
        weights[key] = w0 + adapter.scale * delta
    return LlamaModel(model.cfg, weights, device=model.device, dtype=model.dtype)


def greedy_generate(model: LlamaModel, prompt: Sequence[int], max_tokens: int,
                    lora: LoraHook | None = None, stop_ids: Sequence[int] = ()) -> list[int]:
    """Reference single-sequence greedy decoding (prefill, then one token per step)."""
    cache = model.new_cache(len(prompt) + max_tokens)
    out: list[int] = []
    tokens = list(prompt)
    for _ in range(max_tokens):
        logits = model.forward([SequenceStep(tokens, cache)], lora)
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        tokens = [nxt]
    return out
