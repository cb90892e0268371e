"""Reading an engine's load from its Prometheus ``GET /metrics`` (text exposition format).

vLLM: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``; SGLang:
``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``. Each may come as several series
(one per ``engine``/``model_name``/data-parallel rank): the load is their sum.

The parser is small and tolerant on purpose: it reads sample lines
(``name{label="value",...} value [timestamp]``, OpenMetrics exemplars after ``#``
ignored), skips comments, blank and malformed lines, and never raises on content. A
metric that is absent means the engine does not say (None), not zero.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

from gpu_agent.connectors.base import ConnectorError, EngineLoad, EngineUnavailable

__all__ = ["Sample", "parse_samples", "sum_samples", "load_from_metrics", "scrape_load",
           "VLLM_LOAD", "SGLANG_LOAD"]

VLLM_LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting")
SGLANG_LOAD = ("sglang:num_running_reqs", "sglang:num_queue_reqs")

_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*\"")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def _labels(line: str, i: int) -> tuple[dict[str, str], int] | None:
    """Labels from ``line[i] == "{"``; (labels, index after "}") or None when malformed."""
    labels: dict[str, str] = {}
    i += 1
    while True:
        while i < len(line) and line[i] in " ,":
            i += 1
        if i < len(line) and line[i] == "}":
            return labels, i + 1
        m = _LABEL_NAME.match(line, i)
        if m is None:
            return None
        i, chars = m.end(), []
        while i < len(line) and line[i] != '"':
            if line[i] == "\\" and i + 1 < len(line):
                i += 1
                chars.append(_ESCAPES.get(line[i], "\\" + line[i]))
            else:
                chars.append(line[i])
            i += 1
        if i >= len(line):
            return None  # unterminated value
        labels[m.group(1)] = "".join(chars)
        i += 1


def parse_samples(text: str) -> Iterator[Sample]:
    """Every well-formed sample line of ``text``; anything else is skipped."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if m is None:
            continue
        i, labels = m.end(), {}
        if i < len(line) and line[i] == "{":
            parsed = _labels(line, i)
            if parsed is None:
                continue
            labels, i = parsed
        rest = line[i:].split("#", 1)[0].split()
        if not rest:
            continue
        try:
            value = float(rest[0])  # also NaN, +Inf, -Inf
        except ValueError:
            continue
        yield Sample(m.group(0), labels, value)


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Per name in ``names``: the sum over its series (NaN series skipped); absent names
    are missing from the result."""
    wanted = set(names)
    out: dict[str, float] = {}
    for s in parse_samples(text):
        if s.name in wanted and not math.isnan(s.value):
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def load_from_metrics(text: str, running: str, waiting: str) -> EngineLoad | None:
    """The engine's load from its exposition text; None unless both metrics are there."""
    sums = sum_samples(text, (running, waiting))
    if running not in sums or waiting not in sums:
        return None
    if not all(math.isfinite(v) for v in sums.values()):
        return None
    return EngineLoad(running=max(0, round(sums[running])), waiting=max(0, round(sums[waiting])))


async def scrape_load(client, engine: str, names: tuple[str, str], timeout_s: float) -> EngineLoad | None:
    """``GET /metrics`` on ``client`` (an ``httpx.AsyncClient`` with the engine's base URL)
    and read the load; EngineUnavailable when it does not answer, ConnectorError on a
    non-200 answer."""
    import httpx

    try:
        resp = await client.get("/metrics", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"{engine} /metrics: {exc!r}") from exc
    if resp.status_code != 200:
        raise ConnectorError(f"{engine} /metrics: HTTP {resp.status_code}")
    return load_from_metrics(resp.text, *names)
