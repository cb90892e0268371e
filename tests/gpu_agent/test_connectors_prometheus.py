"""Engine load from Prometheus text: the tolerant parser, and the vLLM/SGLang connectors'
`engine_load` against loopback HTTP servers that serve real-looking /metrics."""
from __future__ import annotations

import asyncio

import pytest

from gpu_agent.connectors.base import ConnectorError, EngineLoad, EngineUnavailable
from gpu_agent.connectors.prometheus import (SGLANG_LOAD, VLLM_LOAD, load_from_metrics, parse_samples,
                                             sum_samples)
from gpu_agent.connectors.sglang import SGLangConnector
from gpu_agent.connectors.vllm import VLLMConnector
from tests.gpu_agent.agent_support import SGLANG_TEXT, VLLM_TEXT, metrics_server
from tests.support.procs import free_port


def test_real_looking_vllm_text_sums_the_engines_and_ignores_look_alikes():
    assert load_from_metrics(VLLM_TEXT, *VLLM_LOAD) == EngineLoad(running=5, waiting=7)
    sums = sum_samples(VLLM_TEXT, ["vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc"])
    assert sums == {"vllm:num_requests_waiting_by_reason": 7.0, "vllm:kv_cache_usage_perc": 0.42}


def test_real_looking_sglang_text():
    assert load_from_metrics(SGLANG_TEXT, *SGLANG_LOAD) == EngineLoad(running=4, waiting=11)


def test_parser_is_tolerant_of_odd_but_valid_and_of_broken_lines():
    text = (
        'no_labels 1\n'
        'empty_labels{} 2 1712345678000\n'                      # a timestamp
        '  spaced{ a = "x" , } 3\n'                             # spaces, trailing comma
        'tricky{path="C:\\\\dir",q="say \\"hi\\", {ok}",n="a\\nb"} 4\n'  # escapes, braces in a value
        'exemplar_total{le="1"} 5 # {trace_id="abc"} 0.5\n'     # OpenMetrics exemplar
        'nan_gauge NaN\n'
        'inf_gauge +Inf\n'
        '\n'
        '# a comment\n'
        'broken{a="unterminated 6\n'
        'novalue{a="b"}\n'
        'bad_value{a="b"} twelve\n'
        '{"json": true}\n'
        '9starts_with_digit 7\n'
        'garbage line here\n'
    )
    got = {s.name: (dict(s.labels), s.value) for s in parse_samples(text)}
    assert got["no_labels"] == ({}, 1.0)
    assert got["empty_labels"] == ({}, 2.0)
    assert got["spaced"] == ({"a": "x"}, 3.0)
    assert got["tricky"] == ({"path": "C:\\dir", "q": 'say "hi", {ok}', "n": "a\nb"}, 4.0)
    assert got["exemplar_total"] == ({"le": "1"}, 5.0)
    assert got["inf_gauge"][1] == float("inf")
    assert set(got) == {"no_labels", "empty_labels", "spaced", "tricky", "exemplar_total", "nan_gauge",
                        "inf_gauge"}
    assert list(parse_samples("")) == []
    assert list(parse_samples("\x00\xff{{{}}} \n###")) == []


def test_a_load_needs_both_metrics_and_finite_values():
    assert load_from_metrics("", *VLLM_LOAD) is None
    assert load_from_metrics("vllm:num_requests_running 1\n", *VLLM_LOAD) is None
    both = "vllm:num_requests_running 1\nvllm:num_requests_waiting {}\n"
    assert load_from_metrics(both.format("NaN"), *VLLM_LOAD) is None      # a NaN series is skipped: absent
    assert load_from_metrics(both.format("+Inf"), *VLLM_LOAD) is None
    assert load_from_metrics(both.format("-2"), *VLLM_LOAD) == EngineLoad(1, 0)
    assert load_from_metrics(both.format("2.6"), *VLLM_LOAD) == EngineLoad(1, 3)


def test_engine_load_ignores_its_timestamp_in_equality():
    assert EngineLoad(1, 2, measured_unix_ms=5) == EngineLoad(1, 2, measured_unix_ms=9)
    assert EngineLoad(1, 2).requests == 3


@pytest.mark.parametrize("make, text, expected", [
    (lambda url, **kw: VLLMConnector(url, metrics_max_age_s=0.0, **kw), VLLM_TEXT, EngineLoad(5, 7)),
    (lambda url, **kw: SGLangConnector(url, metrics_max_age_s=0.0, **kw), SGLANG_TEXT, EngineLoad(4, 11)),
])
def test_connectors_scrape_their_engine_over_http(make, text, expected):
    async def main():
        state = {"text": text}
        async with metrics_server(state) as url:
            conn = make(url, metrics_timeout_s=0.2)
            try:
                assert await conn.engine_load() == expected
                state["text"] = "# nothing about load here\nprocess_cpu_seconds_total 1.0\n"
                assert await conn.engine_load() is None           # the engine does not say
                state["status"] = 500
                with pytest.raises(ConnectorError, match="500"):
                    await conn.engine_load()
                state.update(status=200, text=text, delay_s=1.0)
                with pytest.raises(EngineUnavailable):             # slower than the scrape timeout
                    await conn.engine_load()
            finally:
                await conn.close()
    asyncio.run(main())


def test_unreachable_engine_load_raises_engine_unavailable():
    async def main():
        url = f"http://127.0.0.1:{free_port()}"
        for conn in (VLLMConnector(url), SGLangConnector(url)):
            try:
                with pytest.raises(EngineUnavailable):
                    await conn.engine_load()
            finally:
                await conn.close()
    asyncio.run(main())


def test_the_vllm_connector_shares_its_metrics_reads():
    """vLLM renders /metrics on the loop that accepts its requests (~4 ms a read): the load,
    the idle wait and the busy checks share one read per max age, concurrent callers share
    the read in flight, a failed read is not kept, and a busy check before an eviction
    reads fresh."""
    async def main():
        state = {"text": VLLM_TEXT, "delay_s": 0.05}
        async with metrics_server(state) as url:
            conn = VLLMConnector(url, metrics_max_age_s=3600.0)
            try:
                loads = await asyncio.gather(*(conn.engine_load() for _ in range(5)))
                assert loads == [EngineLoad(5, 7)] * 5 and state["scrapes"] == 1   # one read in flight, shared
                assert await conn.engine_load() == EngineLoad(5, 7) and state["scrapes"] == 1  # within its age
                await conn.busy()
                assert state["scrapes"] == 2                                      # an eviction's check: fresh
                state["status"] = 500
                with pytest.raises(ConnectorError):
                    await conn.metrics.text(max_age_s=0.0)
                assert await conn.busy() == set() and state["scrapes"] == 4      # failures are not kept
                state["status"] = 200
                assert await conn.metrics.text(max_age_s=0.0) == VLLM_TEXT and state["scrapes"] == 5
            finally:
                await conn.close()
    asyncio.run(main())


def test_the_vllm_connector_asks_for_its_metrics_by_name_and_reads_the_page_whole_if_refused():
    """vLLM renders its whole /metrics page in 4.4 ms on its request loop, the three series
    the agent reads in 0.8 ms: asked for by name (``/metrics/?name[]=``); an engine that
    does not serve that path is read whole from then on."""
    busy_text = VLLM_TEXT                               # running a, b; waiting c

    async def main():
        state = {"text": busy_text, "names": True}
        async with metrics_server(state) as url:
            conn = VLLMConnector(url, metrics_max_age_s=0.0)
            try:
                assert await conn.engine_load() == EngineLoad(5, 7)
                assert await conn.busy() == {"a", "b", "c"}
                assert state["by_name"] == 2 and state.get("scrapes", 0) == 0
            finally:
                await conn.close()
        state = {"text": busy_text}                  # no /metrics/ route: 404 there
        async with metrics_server(state) as url:
            conn = VLLMConnector(url, metrics_max_age_s=0.0)
            try:
                assert await conn.engine_load() == EngineLoad(5, 7)
                assert await conn.busy() == {"a", "b", "c"}
                assert state["scrapes"] == 2                           # whole, and only whole, after the 404
            finally:
                await conn.close()
    asyncio.run(main())
