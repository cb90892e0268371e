"""The served model's tokenizer: `tokenizer.json` plus the chat template of `tokenizer_config.json`.

Mirrors how vLLM prepares prompts so both engines see the same ids: a completion prompt
is encoded with the special tokens of the post-processor (BOS); a chat is rendered with
the Jinja chat template (which writes its own BOS) and encoded without them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from gpu_agent.errors import AgentError


class ChatTemplateError(AgentError, ValueError):
    """The messages cannot be rendered with the model's chat template."""


class ModelTokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        p = Path(model_dir)
        self._tok = Tokenizer.from_file(str(p / "tokenizer.json"))
        cfg_path = p / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template_src = cfg.get("chat_template")
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def template_compiled(self) -> bool:
        return self._template is not None

    def compile_template(self) -> None:
        """Import Jinja and compile the chat template (about 50 ms the first time, on the
        caller's thread): the engine does it at start-up, not on its first chat request."""
        if self._template is None and self._template_src:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self._template_src)

    def render_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if not self._template_src:
            raise ChatTemplateError("the model has no chat_template")
        self.compile_template()
        try:
            return self._template.render(messages=list(messages), bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "",
                                         add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja raises many types; the caller maps one to 400
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class IncrementalDecoder:
    """Text deltas for streaming: decode the output in the context of the prompt's tail.

    Metaspace decoding depends on context (a leading space is dropped at the start of a
    text), so the output is decoded after the last prompt tokens and the context's own
    text is cut off: a continuation keeps its leading space, as vLLM's detokenizer does.
    Decoding token by token would garble text; decoding the whole output each time
    does not.
    """

    CONTEXT = 6

    def __init__(self, tok: ModelTokenizer, prompt: Sequence[int] = ()):
        self._tok = tok
        self._ctx = list(prompt[-self.CONTEXT:])
        self._ctx_text = tok.decode(self._ctx)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self._tok.decode(self._ctx + self.ids)
        text = full[len(self._ctx_text):] if full.startswith(self._ctx_text) else self._tok.decode(self.ids)
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in newer tokenizer_config files
        return tok.get("content")
    return tok
