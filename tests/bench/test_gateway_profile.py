"""bench.gateway_profile drives the real h2 loop with Envoy's bytes: it must stay runnable."""
from bench.gateway_overhead import _chat_body
from bench.gateway_profile import _SECTIONS, Feed, count_streams, envoy_message, run, sections
from extproc.app.context import Gateway
from extproc.state.store import Store
from extproc.protocols.wire import pb
from tests.extproc.builders import KEYS, upstream, write_state


def test_profile_feeds_whole_streams_and_times_every_section(tmp_path):
    state = write_state(tmp_path, [upstream("bench-upstream", "127.0.0.1:9", "vllm", "body")])
    store = Store(state, tmp_path / "gw.sqlite3")
    message = envoy_message(_chat_body(), KEYS["alice"])
    head = pb.ProcessingRequest.FromString(message)
    assert head.request_body.end_of_stream and head.protocol_config.request_body_mode == 2
    for gateway in (None, Gateway(store)):
        feed = Feed(gateway)
        out = run(feed, message, 20, cold=False)
        assert out["writes_per_stream"] == 1.0          # the answer; the trailers are dropped
        assert not feed.conn.calls and not feed.conn.broken
    spent = sections(feed, message, 20, cold=False)
    assert set(spent) == {label for *_, label in _SECTIONS} | {"whole read (HEADERS + DATA)"}
    store.close()


def test_instruction_count_feeds_only_the_streams():
    """What ``--instructions`` runs under callgrind: n whole streams, one answer each."""
    for server in ("null", "gateway"):
        assert count_streams(server, 7) == 7
