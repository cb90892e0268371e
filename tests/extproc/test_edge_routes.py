"""Default deny at the edge (extproc.state.paths), without sockets: which paths reach an engine,
which the gateway answers (the model list), and 404 for the rest."""
from __future__ import annotations

import json

import pytest

from extproc.errors import ConfigError
from extproc.app.outcomes import CONTINUE, Continue, Reply, RequestHead
from extproc.app.context import Gateway
from extproc.state.store import Store
from tests.extproc.builders import KEYS, upstream, write_state


def _head(path, method="POST", eos=False, key="bob", **headers):
    h = {":path": path, ":method": method}
    if key is not None:
        h["authorization"] = f"Bearer {KEYS[key]}"
    h.update(headers)
    return RequestHead(method, path.split("?")[0], h, eos)


def _store(tmp_path, upstreams, **fields) -> Store:
    return Store(write_state(tmp_path, upstreams, **fields), tmp_path / "gw.sqlite3", watch=False)


@pytest.fixture
def gw(store):
    return Gateway(store)


def _error(out) -> dict:
    assert isinstance(out, Reply), out
    return {"status": out.status, **json.loads(out.body)["error"]}


# ---------- anything else: 404 after the key check ----------

@pytest.mark.parametrize("path", ["/metrics", "/v1/load_lora_adapter", "/load_lora_adapter", "/tokenize",
                                  "/v2/x", "/version", "/v1/chat/completions/", "//v1//chat/completions",
                                  "/v1/load%5Flora%5Fadapter", "/flush_cache", "/server_info"])
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_every_other_path_is_404_with_a_key_and_401_without(gw, path, method):
    err = _error(gw.exchange().on_request_headers(_head(path, method, eos=method == "GET")))
    assert (err["status"], err["code"], err["type"]) == (404, "unknown_route", "invalid_request_error")
    err = _error(gw.exchange().on_request_headers(_head(path, method, key=None)))
    assert (err["status"], err["code"]) == (401, "missing_api_key")


def test_health_is_open_without_a_key_for_get_only(gw):
    for method in ("GET", "HEAD"):
        ex = gw.exchange()
        assert ex.on_request_headers(RequestHead(method, "/health", {}, True)) is CONTINUE
        assert ex.done_after("request_headers")
    assert _error(gw.exchange().on_request_headers(RequestHead("POST", "/health", {}, False)))["status"] == 405


# ---------- GET /v1/models: the gateway's answer ----------

def _models(gw, key, path="/v1/models") -> dict:
    out = gw.exchange().on_request_headers(_head(path, "GET", True, key=key))
    assert isinstance(out, Reply) and out.status == 200, out
    return json.loads(out.body)


def test_model_list_is_base_models_and_the_keys_visible_adapters_in_openai_shape(gw):
    listed = _models(gw, "bob")                     # globex
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["ace-tiny-llama", "code-python", "globex-secret"]
    for m in listed["data"]:
        assert m["object"] == "model" and isinstance(m["created"], int)
        assert set(m) <= {"id", "object", "created", "owned_by", "parent"}
    assert [m["owned_by"] for m in listed["data"]] == ["ace", "public", "globex"]
    acme = [m["id"] for m in _models(gw, "alice")["data"]]
    assert acme == ["ace-tiny-llama", "acme-legal", "code-python"]
    assert "/" not in json.dumps(_models(gw, "alice")).replace('"object"', "")   # no paths, no uris


def test_model_by_id_answers_the_visible_and_404s_the_rest_alike(gw):
    assert _models(gw, "bob", "/v1/models/globex-secret")["owned_by"] == "globex"
    assert _models(gw, "bob", "/v1/models/ace-tiny-llama")["id"] == "ace-tiny-llama"
    hidden = _error(gw.exchange().on_request_headers(_head("/v1/models/acme-legal", "GET", True)))
    absent = _error(gw.exchange().on_request_headers(_head("/v1/models/no-such", "GET", True)))
    assert hidden["status"] == absent["status"] == 404
    assert hidden["code"] == absent["code"] == "model_not_found"
    assert hidden["message"].replace("acme-legal", "X") == absent["message"].replace("no-such", "X")


def test_model_list_needs_a_key_and_get(gw):
    assert _error(gw.exchange().on_request_headers(_head("/v1/models", "GET", True, key=None)))["status"] == 401
    assert _error(gw.exchange().on_request_headers(
        _head("/v1/models", "GET", True, key=None, authorization="Bearer nope")))["status"] == 401
    assert _error(gw.exchange().on_request_headers(_head("/v1/models", "POST")))["status"] == 405


def test_public_model_list_answers_without_a_key_with_public_adapters_only(tmp_path):
    store = _store(tmp_path, [upstream("v", "127.0.0.1:8000")], public_model_list=True)
    try:
        gw = Gateway(store)
        assert [m["id"] for m in _models(gw, None)["data"]] == ["ace-tiny-llama", "code-python"]
        assert _models(gw, None, "/v1/models/code-python")["id"] == "code-python"
        assert _error(gw.exchange().on_request_headers(_head("/v1/models/acme-legal", "GET", True, key=None)))[
            "status"] == 404
        # a key still sees its own; a wrong key is still refused
        assert "acme-legal" in [m["id"] for m in _models(gw, "alice")["data"]]
        wrong = _head("/v1/models", "GET", True, key=None, authorization="Bearer nope")
        assert _error(gw.exchange().on_request_headers(wrong))["status"] == 401
    finally:
        store.close()


# ---------- routes only some flavours serve ----------

def _decide(gw, path, body, key="bob"):
    ex = gw.exchange()
    assert ex.on_request_headers(_head(path, key=key)) is CONTINUE
    return ex.on_request_body(json.dumps(body).encode())


@pytest.mark.parametrize("path, flavour", [("/v1/embeddings", "builtin"), ("/v1/responses", "sglang")])
def test_a_route_no_upstream_flavour_serves_is_404(tmp_path, path, flavour):
    store = _store(tmp_path, [upstream("only", "127.0.0.1:8000", flavour)])
    try:
        err = _error(_decide(Gateway(store), path, {"model": "code-python", "input": "x"}))
        assert (err["status"], err["code"]) == (404, "route_not_served")
    finally:
        store.close()


@pytest.mark.parametrize("path, serving", [("/v1/embeddings", "vllm"), ("/v1/responses", "builtin")])
def test_a_flavour_route_goes_to_an_upstream_that_serves_it(tmp_path, path, serving):
    other = "builtin" if serving == "vllm" else "sglang"
    store = _store(tmp_path, [upstream("first", "127.0.0.1:8000", other), upstream("serves", "127.0.0.1:8001", serving)])
    try:
        out = _decide(Gateway(store), path, {"model": "code-python", "input": "hi"})
        assert isinstance(out, Continue), out
        meta = dict(out.metadata)
        assert meta["destination"] == "127.0.0.1:8001"
        assert "adapter=code-python" in meta["trace_multi_lora"]
        assert json.loads(out.body)["model"] == "code-python"
    finally:
        store.close()


def test_responses_selects_by_extra_body_and_hides_other_tenants(gw):
    out = _decide(gw, "/v1/responses", {"model": "ace-tiny-llama", "input": "hi", "stream": True,
                                         "extra_body": {"lora_name": "globex-secret"}})
    sent = json.loads(out.body)
    assert (sent["model"], sent["stream"], sent["input"]) == ("globex-secret", True, "hi")
    err = _error(_decide(gw, "/v1/responses", {"lora_name": "acme-legal", "input": "hi"}))
    assert (err["status"], err["code"]) == (404, "adapter_not_found")


# ---------- an upstream's allow_paths ----------

def _allowing(tmp_path) -> Store:
    return _store(tmp_path, [upstream("plain", "127.0.0.1:8000"),
                             upstream("tok", "127.0.0.1:8001", allow_paths=["/tokenize", "/version"])])


def test_allow_listed_path_is_key_checked_and_routed_to_an_upstream_listing_it(tmp_path):
    store = _allowing(tmp_path)
    try:
        gw = Gateway(store)
        ex = gw.exchange()
        out = ex.on_request_headers(_head("/version", "GET", True))
        assert isinstance(out, Continue) and dict(out.metadata) == {"destination": "127.0.0.1:8001",
                                                                    "tenant": "globex"}
        assert ex.done_after("request_headers")
        assert _error(gw.exchange().on_request_headers(_head("/version", "GET", True, key=None)))["status"] == 401
        out = _decide(gw, "/tokenize", {"model": "code-python", "prompt": "hi"})
        assert dict(out.metadata)["destination"] == "127.0.0.1:8001"
        assert json.loads(out.body)["model"] == "code-python"
        err = _error(_decide(gw, "/tokenize", {"lora_name": "acme-legal", "prompt": "hi"}))
        assert (err["status"], err["code"]) == (404, "adapter_not_found")
        assert _error(gw.exchange().on_request_headers(_head("/detokenize")))["code"] == "unknown_route"
    finally:
        store.close()


@pytest.mark.parametrize("path", ["/metrics", "/v1/load_lora_adapter", "/v1/models", "/v1/chat/completions",
                                  "/api/v1/me", "tokenize", "/tokenize/", "//tokenize", "/health"])
def test_state_file_refuses_allow_paths_that_would_open_a_door(tmp_path, path):
    with pytest.raises(ConfigError) as exc:
        _store(tmp_path, [upstream("v", "127.0.0.1:8000", allow_paths=[path])])
    assert exc.value.field == "upstreams[0].allow_paths[0]"


@pytest.mark.parametrize("key, model", [("bob", "acme-legal"), ("bob", "no-such"), ("carol", "globex-secret")])
def test_a_model_name_the_tenant_may_not_use_never_reaches_the_engine(gw, key, model):
    """bob (globex, no default adapter) and carol (acme, multi_lora shadow: the default is not
    applied): the name goes nowhere, the base model goes instead, whether it is another
    tenant's adapter or unknown."""
    out = _decide(gw, "/v1/chat/completions", {"model": model, "messages": []}, key=key)
    assert isinstance(out, Continue) and json.loads(out.body)["model"] == "ace-tiny-llama"
