"""A vLLM general plugin that changes nothing and logs one line per LoRA read into vLLM's
CPU cache.

vLLM reads an adapter's weights into its CPU LRU cache (``--max-cpu-loras``) when it is
registered (``/v1/load_lora_adapter``, or the filesystem resolver for a request naming
an unknown adapter) and again, silently, when a request uses a registered adapter that
the cache's LRU had dropped. vLLM 0.32 logs the first two and not the third, so a
benchmark that counted only registrations missed those re-reads, or had to keep the
registry at the cache's size by unloading (and race the requests it did not see). With
this plugin every read is one line (``MARK``) in vLLM's log, in whichever process
serves the engine. ``make`` installs it into ``.venv-vllm``; ``tools.vllm_fleet`` names
it in ``VLLM_PLUGINS``; ``bench.vllm_eval`` counts the lines.
"""
from __future__ import annotations

MARK = "ace-measure: LoRA read into the CPU cache:"
REGISTERED = "ace-measure: plugin registered"


def register() -> None:
    """vLLM calls this in each of its processes (possibly more than once)."""
    from vllm.lora import worker_manager

    manager = worker_manager.WorkerLoRAManager
    if getattr(manager._load_adapter, "ace_measured", False):
        return
    load = manager._load_adapter

    def _load_adapter(self, lora_request):
        model = load(self, lora_request)
        print(f"{MARK} {lora_request.lora_name}", flush=True)
        return model

    _load_adapter.ace_measured = True
    manager._load_adapter = _load_adapter
    print(REGISTERED, flush=True)
