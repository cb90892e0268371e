"""Deterministic local fixtures: a tiny Llama checkpoint, its tokenizer and PEFT adapters.

`python -m gpu_agent.fixtures --out .fixtures` writes (layout in docs/contracts.md):

    model/      config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
                special_tokens_map.json, generation_config.json   (HF Llama naming)
    adapters/<name>/adapter_config.json, adapter_model.safetensors (PEFT LoRA)
    catalog.yaml

Nothing comes from a hub; every tensor is drawn from a seeded generator, so two runs
write the same bytes (the catalog's sha256 digests are stable). `make_adapter` is public
so the benchmarks can make adapters of any rank for any base shape.

Scales are chosen so the fixtures are useful, not so they imitate a trained model: hidden
activations stay near unit RMS, logits have a spread of a few units (greedy argmax is not
decided by float noise), and every adapter's delta is about as large as the base weight,
so each adapter's greedy output differs from the base model's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

BASE_MODEL_NAME = "ace-tiny-llama"
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
# Roles become special tokens so the template needs no newline (not in the alphabet).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
MODEL_SEED = 20261130
ADAPTER_SEED_BASE = 1000


@dataclass(frozen=True)
class ModelShape:
    """Architecture of a Llama checkpoint, enough to size its tensors and adapters."""

    name: str = BASE_MODEL_NAME
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Attention projections as `module -> (in_features, out_features)`."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "bos_token_id": SPECIAL_TOKENS.index(BOS),
            "eos_token_id": SPECIAL_TOKENS.index(EOS),
            "torch_dtype": "float32",
            "use_cache": True,
            "transformers_version": "4.57.0",
        }


TINY_LLAMA = ModelShape()


@dataclass(frozen=True)
class AdapterDef:
    name: str
    rank: int
    domain: str
    owner: str
    use_rslora: bool = False

    @property
    def alpha(self) -> int:
        # PEFT's common alpha = 2r gives scale 2; for rsLoRA keep the scale near 2 too.
        return max(1, round(2 * math.sqrt(self.rank))) if self.use_rslora else 2 * self.rank


ADAPTERS: tuple[AdapterDef, ...] = (
    AdapterDef("code-python", 8, "coding", "acme"),
    AdapterDef("code-sql", 32, "coding", "acme"),
    AdapterDef("med-triage", 16, "medical", "medco"),
    AdapterDef("med-notes", 64, "medical", "medco"),
    AdapterDef("legal-contracts", 32, "legal", "public"),
    AdapterDef("legal-review", 128, "legal", "public", use_rslora=True),
    AdapterDef("fin-reports", 8, "finance", "public"),
    AdapterDef("fin-risk", 64, "finance", "public"),
    AdapterDef("tr-de-en", 16, "translation", "public"),
    AdapterDef("tr-fr-en", 128, "translation", "public"),
)


@dataclass(frozen=True)
class AdapterFiles:
    """What `make_adapter` wrote: the catalog needs the size and digest."""

    name: str
    path: Path
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    size_bytes: int
    sha256: str
    use_rslora: bool = False


def _generator(seed: int):
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(shape: Sequence[int], std: float, g):
    import torch

    return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).contiguous()


def _save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates 0600; other users (a vLLM venv) read it


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def adapter_seed(name: str) -> int:
    """A stable per-name seed (crc32 is fixed across runs and platforms, unlike hash())."""
    return ADAPTER_SEED_BASE + zlib.crc32(name.encode())


def make_adapter(out_dir: str | Path, name: str, rank: int, *, seed: int | None = None,
                 alpha: int | None = None,
                 target_modules: Iterable[str] = LORA_TARGET_MODULES,
                 base: ModelShape = TINY_LLAMA, use_rslora: bool = False,
                 b_gain: float = 0.5, dtype: str = "float32") -> AdapterFiles:
    """Write a PEFT LoRA adapter directory `out_dir/name` and return its size and digest.

    A ~ N(0, 1/in) and B ~ N(0, b_gain^2/r), so `x A^T B^T` has about b_gain times the RMS
    of x, times the LoRA scale (alpha/r, or alpha/sqrt(r) with rsLoRA).
    """
    import torch

    if rank <= 0:
        raise ValueError(f"rank must be positive, got {rank}")
    modules = tuple(target_modules)
    shapes = base.module_shapes()
    unknown = [m for m in modules if m not in shapes]
    if unknown:
        raise ValueError(f"unsupported target modules {unknown}; supported: {sorted(shapes)}")
    alpha = 2 * rank if alpha is None else alpha
    g = _generator(adapter_seed(name) if seed is None else seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module in modules:
            fin, fout = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = _randn((rank, fin), 1 / math.sqrt(fin), g)
            tensors[f"{prefix}.lora_B.weight"] = _randn((fout, rank), b_gain / math.sqrt(rank), g)
    torch_dtype = getattr(torch, dtype)
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}
    path = Path(out_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "adapter_config.json", {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base.name,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    })
    weights = path / "adapter_model.safetensors"
    _save_safetensors(tensors, weights)
    return AdapterFiles(name=name, path=path, rank=rank, alpha=alpha, target_modules=modules,
                        size_bytes=weights.stat().st_size, sha256=_sha256(weights),
                        use_rslora=use_rslora)


def base_model_tensors(shape: ModelShape = TINY_LLAMA, seed: int = MODEL_SEED) -> dict:
    """Random-init Llama weights under HF names (fp32), drawn in a fixed order."""
    import torch

    g = _generator(seed)
    h, inter = shape.hidden_size, shape.intermediate_size
    mods = shape.module_shapes()
    t = {"model.embed_tokens.weight": _randn((shape.vocab_size, h), 1.0, g)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        for m in LORA_TARGET_MODULES:
            fin, fout = mods[m]
            t[f"{p}.self_attn.{m}.weight"] = _randn((fout, fin), 1 / math.sqrt(fin), g)
        t[f"{p}.mlp.gate_proj.weight"] = _randn((inter, h), 1 / math.sqrt(h), g)
        t[f"{p}.mlp.up_proj.weight"] = _randn((inter, h), 1 / math.sqrt(h), g)
        t[f"{p}.mlp.down_proj.weight"] = _randn((h, inter), 1 / math.sqrt(inter), g)
        t[f"{p}.input_layernorm.weight"] = torch.ones(h)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    t["model.norm.weight"] = torch.ones(h)
    # Logit spread of ~4 keeps greedy argmax well clear of float noise.
    t["lm_head.weight"] = _randn((shape.vocab_size, h), 4 / math.sqrt(h), g)
    return t


# A small fixed corpus across the five domains; the BPE merges come from it.
_CORPUS = """
def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
import os, sys, json; from pathlib import Path; print(json.dumps({"key": [1, 2, 3]}))
for item in items: if item is not None and item.value > 0: total += item.value
class Request: def __init__(self, model, prompt): self.model = model; self.prompt = prompt
with open(path, "r") as handle: lines = [line.strip() for line in handle if line]
try: result = client.get(url, timeout=5.0) except TimeoutError as exc: raise RuntimeError(exc)
SELECT name, SUM(amount) AS total FROM orders WHERE created_at >= '2026-01-01' GROUP BY name;
SELECT c.id, c.email FROM customers c JOIN orders o ON o.customer_id = c.id ORDER BY o.total DESC LIMIT 10;
INSERT INTO accounts (id, owner, balance) VALUES (42, 'acme', 1000.00); UPDATE accounts SET balance = 0;
CREATE TABLE patients (id INTEGER PRIMARY KEY, name TEXT NOT NULL, admitted DATE);
Patient reports chest pain and shortness of breath for two days; blood pressure 150/95, pulse 110.
Triage level 2: urgent assessment, ECG within ten minutes, oxygen saturation 93 percent on room air.
The patient has a history of diabetes and hypertension and takes metformin and lisinopril daily.
Clinical notes: no fever, mild cough, lungs clear on auscultation, follow up with the physician in one week.
Allergies: penicillin. Medication review completed; dosage adjusted for reduced kidney function.
This Agreement is entered into by and between the Parties as of the Effective Date written above.
The Supplier shall indemnify and hold harmless the Customer against all claims, damages and liabilities.
Either party may terminate this contract upon thirty days written notice to the other party.
Confidential Information shall not be disclosed to any third party without prior written consent.
The court held that the clause was unenforceable because the terms were not reasonably clear.
Governing law: this contract shall be governed by the laws of the State of New York.
Quarterly revenue increased 12 percent year over year to 4.2 billion dollars, driven by strong demand.
Operating margin declined to 18 percent as costs for materials and logistics rose sharply.
The risk model estimates a value at risk of 3.5 million at the 99 percent confidence level.
Credit exposure to the energy sector was reduced; liquidity ratios remain above regulatory minimums.
Net income, earnings per share, cash flow and the balance sheet are reported in the annual report.
Der Vertrag wurde gestern unterzeichnet und tritt am ersten Januar in Kraft.
Ich habe heute keine Zeit, aber wir koennen uns morgen im Buero treffen.
Die Ergebnisse des Quartals waren besser als erwartet, sagte der Vorstand.
Le contrat a ete signe hier et entre en vigueur le premier janvier.
Je n'ai pas le temps aujourd'hui, mais nous pouvons nous voir demain au bureau.
Les resultats du trimestre etaient meilleurs que prevu, a declare la direction.
Translate from German to English: Guten Morgen, wie geht es Ihnen heute?
Translate from French to English: Bonjour, comment allez-vous aujourd'hui?
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
Hello! How can I help you today? Please explain the answer step by step, with examples.
Summarize the following text in three sentences and list the most important facts.
What is the capital of France? Paris is the capital and the largest city of France.
A model serves many adapters behind one base model; each request names its adapter.
""".strip()


def train_tokenizer(vocab_size: int = TINY_LLAMA.vocab_size):
    """BPE over printable ASCII with Metaspace (vLLM's detokenizer needs no byte level)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Newlines and tabs are not in the alphabet: fold them to spaces rather than <unk>.
    tok.normalizer = normalizers.Sequence([normalizers.Replace("\n", " "),
                                           normalizers.Replace("\t", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["\u2581"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet))
    lines = _CORPUS.splitlines()
    # Several passes in a fixed order: counts scale, merges (and their ties) stay fixed.
    tok.train_from_iterator(lines * 4, trainer=trainer)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos), (EOS, eos)])
    return tok


def write_tokenizer(model_dir: Path, shape: ModelShape = TINY_LLAMA) -> None:
    tok = train_tokenizer(shape.vocab_size)
    if tok.get_vocab_size() > shape.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {shape.vocab_size}")
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} is not id {i}")
    tok.save(str(model_dir / "tokenizer.json"), pretty=True)
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": EOS,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(model_dir / "special_tokens_map.json", {
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
    })


def write_model(model_dir: Path, shape: ModelShape = TINY_LLAMA, seed: int = MODEL_SEED) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    _write_json(model_dir / "config.json", shape.hf_config())
    _write_json(model_dir / "generation_config.json", {
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "transformers_version": "4.57.0",
    })
    _save_safetensors(base_model_tensors(shape, seed), model_dir / "model.safetensors")
    write_tokenizer(model_dir, shape)


def catalog_entry(defn: AdapterDef, files: AdapterFiles, base_name: str = BASE_MODEL_NAME) -> dict:
    return {
        "name": defn.name,
        "base_model": base_name,
        "rank": files.rank,
        "alpha": files.alpha,
        "target_modules": list(files.target_modules),
        "size_bytes": files.size_bytes,
        "owner": defn.owner,
        "domain": defn.domain,
        "uri": f"adapters/{defn.name}",
        "sha256": files.sha256,
    }


def write_catalog(out: Path, entries: list[dict], base_name: str = BASE_MODEL_NAME) -> Path:
    import yaml

    path = out / "catalog.yaml"
    doc = {"base_model": {"name": base_name, "path": "model"}, "adapters": entries}
    path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100))
    return path


def make_fixtures(out: str | Path, adapters: Sequence[AdapterDef] = ADAPTERS) -> Path:
    """Write model, adapters and catalog under `out`; returns the catalog path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_model(out / "model")
    entries = []
    for defn in adapters:
        files = make_adapter(out / "adapters", defn.name, defn.rank, alpha=defn.alpha,
                             use_rslora=defn.use_rslora)
        entries.append(catalog_entry(defn, files))
    return write_catalog(out, entries)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_agent.fixtures", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".fixtures", help="directory to write (created if missing)")
    args = ap.parse_args(argv)
    catalog = make_fixtures(args.out)
    print(f"wrote {catalog.parent}: model/, {len(ADAPTERS)} adapters, {catalog.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
