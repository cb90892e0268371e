"""A vLLM general plugin: ``/v1/unload_lora_adapter`` also drops the adapter's weights from
vLLM's CPU cache, so the agent, not the cache's LRU, decides what leaves it.

vLLM 0.32 keeps a LoRA adapter's weights in a CPU LRU cache (``--max-cpu-loras``) and, on
``/v1/unload_lora_adapter``, only forgets the name: the weights stay cached until that LRU
drops them, and the next read into the full cache evicts the least recently used
adapter, which may be the one a request needs next. The engine already has the call that
drops them (``EngineClient.remove_lora``: the cache and the GPU slot); no HTTP route
calls it. With this plugin the unload route calls it after forgetting the name, and
says so in its answer (``EVICTED``), so the agent (``--vllm-unload-evicts``) knows its
named victims really leave and the next load finds room instead of evicting vLLM's LRU.

Deploy: ``pip install ./tools/vllm_evict`` into vLLM's environment and name it in
``VLLM_PLUGINS`` (with the resolver: ``VLLM_PLUGINS=lora_filesystem_resolver,ace_evict``).
It changes nothing else: loads, requests and the resolver are vLLM's own. An adapter a
request is running with is read back by vLLM at its next step (the agent never unloads
one it sees busy).
"""
from __future__ import annotations

#: appended to the unload route's answer when the weights were dropped from the cache
EVICTED = "(ace: dropped from vLLM's LoRA cache)"
REGISTERED = "ace-evict: plugin registered"


def register() -> None:
    """vLLM calls this in each of its processes (possibly more than once); the route lives
    in the API server's process, where the patch takes effect."""
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # another vLLM layout: change nothing (the agent sees no EVICTED)
        return
    unload = OpenAIServingModels.unload_lora_adapter
    if getattr(unload, "ace_evicts", False):
        return

    async def unload_lora_adapter(self, request, *args, **kwargs):
        known = self.lora_requests.get(request.lora_name)
        answer = await unload(self, request, *args, **kwargs)
        if known is None or not isinstance(answer, str):
            return answer  # an error answer, or nothing was registered: unchanged
        # the name is forgotten; a request naming it again registers a new id (the
        # resolver), so the id dropped here is only the unloaded one
        await self.engine_client.remove_lora(known.lora_int_id)
        return f"{answer} {EVICTED}"

    unload_lora_adapter.ace_evicts = True
    OpenAIServingModels.unload_lora_adapter = unload_lora_adapter
    print(REGISTERED, flush=True)
