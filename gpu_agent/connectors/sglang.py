"""SGLang's runtime LoRA API.

- `POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}` and
  `POST /unload_lora_adapter {"lora_name"}` answer JSON
  `{"success": bool, "error_message": str|null, "loaded_adapters": {name: path}}`,
  200 on success, 400 on failure. At most `--max-loras-per-batch` - 1 can be pinned.
- The loaded set is read from the last `loaded_adapters` the engine sent and, when the
  engine lists adapters in `GET /v1/models` (entries with a `parent`), from there; an
  engine that restarted answers `/v1/models` without them, which the agent notices.
- The engine's load is `sglang:num_running_reqs` + `sglang:num_queue_reqs` from
  `GET /metrics` (SGLang started with `--enable-metrics`; without it: unknown).

SGLang needs a GPU, so this connector is tested against a local server that answers the
documented shapes (tests/gpu_agent/test_connectors_sglang.py), not against SGLang itself.
"""
from __future__ import annotations

from pathlib import Path

import httpx

from ace_common.catalog import Adapter
from gpu_agent.connectors.base import (ConnectorError, EngineConnector, EngineLoad, EngineUnavailable,
                                       listed_adapters)
from gpu_agent.connectors.prometheus import SGLANG_LOAD, MetricsScraper

__all__ = ["SGLangConnector"]


class SGLangConnector(EngineConnector):
    kind = "sglang"
    load_compute_share = 1.0

    def __init__(self, url: str, max_loaded_loras: int | None = None, timeout_s: float = 60.0,
                 api_key: str | None = None, client: httpx.AsyncClient | None = None,
                 metrics_timeout_s: float = 1.0, metrics_max_age_s: float = 0.1):
        self._url = url.rstrip("/")
        self.capacity = max_loaded_loras
        self.metrics_timeout_s = metrics_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(base_url=self._url, timeout=timeout_s, headers=headers)
        self.metrics = MetricsScraper(self._client, "SGLang", metrics_timeout_s, max_age_s=metrics_max_age_s,
                                      names=SGLANG_LOAD)
        self._known: set[str] = set()

    @property
    def url(self) -> str:
        return self._url

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, path: str, body: dict) -> dict:
        try:
            resp = await self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"SGLang {self._url}{path}: {exc!r}") from exc
        try:
            doc = resp.json()
        except ValueError:
            raise ConnectorError(f"SGLang {path}: HTTP {resp.status_code}: {resp.text[:300]}") from None
        if isinstance(doc.get("loaded_adapters"), dict):
            self._known = set(doc["loaded_adapters"])
        return {"status": resp.status_code, **doc}

    async def load(self, spec: Adapter, path: Path, *, pinned: bool = False,
                   demand: bool = False) -> None:
        doc = await self._call("/load_lora_adapter",
                               {"lora_name": spec.name, "lora_path": str(path), "pinned": pinned})
        if doc["status"] == 200 and doc.get("success", False):
            return
        message = str(doc.get("error_message") or "")
        if "already" in message.lower() or spec.name in self._known:
            return
        raise ConnectorError(f"SGLang load {spec.name}: HTTP {doc['status']}: {message[:300]}")

    async def unload(self, name: str) -> None:
        doc = await self._call("/unload_lora_adapter", {"lora_name": name})
        if doc.get("success", False) or name not in self._known:
            return
        raise ConnectorError(f"SGLang unload {name}: {str(doc.get('error_message'))[:300]}")

    async def loaded(self) -> set[str]:
        listed = await listed_adapters(self._client, "SGLang", self._url)
        self._known = listed
        return set(listed)

    async def engine_load(self) -> EngineLoad | None:
        return await self.metrics.load(SGLANG_LOAD)
