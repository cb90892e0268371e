"""The settings page in a real browser (headless Chromium via selenium) against the local
stack: the GPU agent with its builtin engine, the ext_proc gateway and the real Envoy.

Signs in with a tenant admin's key, switches dynamic_lora_prefetch to prod on the page,
sends requests through Envoy until the gateway routes one to the adapter already in the
pool, sees that hit counted on the page (and drawn), then signs in with another tenant's
key and sees none of it; finally a revoked key shows its 401. Every wait is for an element
or an answer, with a failure deadline only.

``ACE_UPDATE_SCREENSHOT=1`` also writes docs/img/settings.png (README "Settings page").
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.browser import chromium
from tests.support.procs import REPO
from tests.support.fixtures import fixtures_dir
from tests.support.wait import scaled, wait_until
from tools.localstack import gateway_stack

pytest.importorskip("torch")
pytestmark = pytest.mark.browser

TOKEN = "settings-test-agent-token"
KEYS = {"acme": "sk-settings-acme-admin", "medco": "sk-settings-medco-dev"}
SCREENSHOT = REPO / "docs" / "img" / "settings.png"


def write_state(path: Path, catalog: Path, engine: str, agent: str) -> dict:
    state = {
        "include": [str(catalog.resolve())],
        "tenants": [{"id": "acme", "default_adapter": "code-python"},
                    {"id": "medco", "default_adapter": "med-triage"}],
        "keys": [{"name": "acme-admin", "sha256": hashlib.sha256(KEYS["acme"].encode()).hexdigest(),
                  "tenant": "acme", "role": "admin"},
                 {"name": "medco-dev", "sha256": hashlib.sha256(KEYS["medco"].encode()).hexdigest(),
                  "tenant": "medco"}],
        "upstreams": [{"name": "engine-1", "address": engine, "flavour": "builtin",
                       "base_model": "ace-tiny-llama", "hints": "body", "agent": agent}],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "off"},
    }
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return state


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    fixtures = fixtures_dir(tmp_path_factory)
    catalog = fixtures / "catalog.yaml"
    work = tmp_path_factory.mktemp("settings-browser")
    with gateway_stack(work, catalog, lambda p, e, a: write_state(p, catalog, e, a), token=TOKEN,
                       agent_args=["--reconcile-interval-s", "0.5"]) as st:   # gateway db: work/gw.sqlite3
        yield {**st, "work": work}


# The page re-renders its tables every 2 s: read in one script call, never through an
# element reference a re-render may have replaced.
_READ = "const e = document.querySelector(arguments[0]); return e && e.getClientRects().length ? e.innerText : '';"
_ALL = "return Array.from(document.querySelectorAll(arguments[0]), e => e.getAttribute(arguments[1]));"


def _text(driver, css: str) -> str:
    return driver.execute_script(_READ, css).strip()


def _attrs(driver, css: str, attr: str) -> list:
    return driver.execute_script(_ALL, css, attr)


def _choose(driver, select_id: str, value: str) -> None:
    """Pick ``value`` as a user does (a re-render between finding and choosing: again)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def attempt(d) -> bool:
        try:
            Select(d.find_element(By.ID, select_id)).select_by_value(value)
            return True
        except StaleElementReferenceException:
            return False
    _until(driver, attempt, f"choose {value} in #{select_id}")


def _until(driver, predicate, what: str):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, scaled(30), poll_frequency=0.05).until(lambda d: predicate(d), message=what)


def _sign_in(driver, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By
    driver.get(base + "/settings")
    _until(driver, lambda d: _text(d, "#signin-section h2") == "Sign in", "the sign-in form")
    driver.find_element(By.ID, "signin-key").send_keys(key)
    driver.find_element(By.ID, "signin").click()


def _completion(base: str, key: str, model: str) -> httpx.Response:
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": model, "prompt": "SELECT name FROM", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_sign_in_switch_prefetch_see_the_hit_and_nothing_of_it_as_another_tenant(stack):
    from selenium.webdriver.common.by import By

    base = stack["gateway"]
    with chromium() as driver:
        _sign_in(driver, base, KEYS["acme"])
        _until(driver, lambda d: "tenant acme · admin" in _text(d, "#who"), "signed in as acme's admin")
        assert _text(driver, "#key-dynamic_lora_prefetch-effective") == "off"
        assert _text(driver, "#key-dynamic_lora_prefetch-source") == "default"
        # the key stays in this tab's sessionStorage: no cookie, nothing in the URL
        assert driver.execute_script("return sessionStorage.getItem('ace.key')") == KEYS["acme"]
        assert driver.get_cookies() == [] and KEYS["acme"] not in driver.current_url
        assert _text(driver, "#tenant-section h2").startswith("Tenant defaults")   # admin

        _choose(driver, "set-key-dynamic_lora_prefetch", "prod")
        _until(driver, lambda d: _text(d, "#key-dynamic_lora_prefetch-source") == "key"
               and _text(d, "#key-dynamic_lora_prefetch-effective") == "prod", "the key's prefetch is prod")
        me = httpx.get(base + "/api/v1/me", headers={"Authorization": f"Bearer {KEYS['acme']}"}).json()
        assert me["key"]["skills"]["dynamic_lora_prefetch"]["effective"] == "prod"

        # through Envoy until a request finds code-python in the pool (the first loads it)
        first = _completion(base, KEYS["acme"], "code-python")
        assert "mode=prod" in first.headers["x-ace-trace-dynamic-lora-prefetch"]   # the page's switch applies
        wait_until(lambda: "residency=device" in _completion(base, KEYS["acme"], "code-python")
                   .headers["x-ace-trace-multi-lora"], timeout=60, interval=0.2,
                   what="a request routed to code-python resident on the device")

        hits = '#adapters td[data-adapter="code-python"][data-field="hits"]'
        _until(driver, lambda d: _text(d, hits) not in ("", "0"), "the hit counted on the page")
        assert int(_text(driver, '#adapters td[data-adapter="code-python"][data-field="requests"]')) >= 2
        assert "engine-1: device" in _text(driver, '#adapters td[data-adapter="code-python"][data-field="residency"]')
        assert _attrs(driver, 'svg[data-adapter="code-python"] rect.hit', "height")     # drawn too
        if os.environ.get("ACE_UPDATE_SCREENSHOT"):
            shot = stack["work"] / "settings.png"
            driver.save_screenshot(str(shot))
            assert shot.stat().st_size < 200_000, shot.stat().st_size
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT)

        # "(not set)" removes the key's runtime setting: the default decides again
        _choose(driver, "set-key-dynamic_lora_prefetch", "")
        _until(driver, lambda d: _text(d, "#key-dynamic_lora_prefetch-source") == "default"
               and _text(d, "#key-dynamic_lora_prefetch-effective") == "off", "the key's prefetch unset")
        me = httpx.get(base + "/api/v1/me", headers={"Authorization": f"Bearer {KEYS['acme']}"}).json()
        assert me["key"]["skills"]["dynamic_lora_prefetch"]["key"] is None

        driver.find_element(By.ID, "signout").click()
        _until(driver, lambda d: _text(d, "#signin-section h2") == "Sign in", "signed out")
        assert driver.execute_script("return sessionStorage.getItem('ace.key')") is None

        driver.find_element(By.ID, "signin-key").send_keys(KEYS["medco"])
        driver.find_element(By.ID, "signin").click()
        _until(driver, lambda d: "tenant medco · developer" in _text(d, "#who"), "signed in as medco")
        _until(driver, lambda d: "med-triage" in _attrs(d, "#adapters tbody tr", "data-adapter"),
               "medco's adapters listed")
        rows = _attrs(driver, "#adapters tbody tr", "data-adapter")
        assert "code-python" not in rows and "code-sql" not in rows and "med-triage" in rows
        assert all(_text(driver, f'#adapters td[data-adapter="{a}"][data-field="requests"]') == "0" for a in rows)
        assert _text(driver, "#tenant-section") == ""                                  # not an admin
        # medco's effective prefetch is still the default: acme's switch was acme's key only
        assert _text(driver, "#key-dynamic_lora_prefetch-effective") == "off"

        # the key revoked while the page is open: the next refresh shows the 401
        from extproc import admin
        digest = hashlib.sha256(KEYS["medco"].encode()).hexdigest()
        assert admin.main(["revoke-key", "--key-sha256", digest, "--db", str(stack["work"] / "gw.sqlite3")]) == 0
        _until(driver, lambda d: _attrs(d, "#error", "data-status") == ["401"],
               "the page shows the revoked key's 401")
        assert "revoked" in _text(driver, "#error")
        assert _text(driver, "#signin-section h2") == "Sign in"


def test_error_states_store_down_503_and_no_agent_unknown(tmp_path):
    """No agent for the host: residency ``unknown``; the shared state store (PostgreSQL)
    down: a write on the page shows the 503, and nothing changed."""
    from tests.extproc.builders import KEYS as BUILDER_KEYS
    from tests.extproc.builders import upstream, write_state as builder_state
    from tests.support.postgres import real_postgres
    from tests.support.upstream import RecordingUpstream
    from tools.localstack import gateway_front

    with real_postgres() as pg, RecordingUpstream() as up, chromium() as driver:
        state = builder_state(tmp_path, [upstream("local-vllm", up.address, "vllm", "body")])
        with gateway_front(tmp_path, state, up.address, extproc_args=["--database-url", pg.url]) as port:
            base = f"http://127.0.0.1:{port}"
            _sign_in(driver, base, BUILDER_KEYS["alice"])            # acme's admin
            _until(driver, lambda d: "tenant acme · admin" in _text(d, "#who"), "signed in as acme's admin")
            _until(driver, lambda d: _text(d, '#adapters td[data-adapter="code-python"][data-field="residency"]')
                   == "local-vllm: unknown", "residency unknown without an agent")
            pg.stop()
            try:
                _choose(driver, "set-tenant-multi_lora", "shadow")
                _until(driver, lambda d: _attrs(d, "#error", "data-status") == ["503"], "the page shows the 503")
                assert "state store is unavailable" in _text(driver, "#error")
                assert _text(driver, "#tenant-multi_lora-effective") == "prod"           # nothing changed
            finally:
                pg.start()


_CLICK = "const b = document.querySelector(arguments[0]); if (b) b.click(); return !!b;"


def test_a_tenant_admin_creates_rotates_and_revokes_keys_on_the_page(tmp_path):
    """acme's admin issues a key on the page (its secret shown once, and it works through
    Envoy), rotates it (the old secret refused at once), revokes a colleague's key; no
    other tenant's key is listed."""
    from selenium.webdriver.common.by import By

    from tests.extproc.builders import KEYS as BUILDER_KEYS
    from tests.extproc.builders import upstream, write_state as builder_state
    from tests.support.upstream import RecordingUpstream
    from tools.localstack import gateway_front

    chat = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    with RecordingUpstream() as up, chromium() as driver:
        state = builder_state(tmp_path, [upstream("local-vllm", up.address, "vllm", "body")])
        with gateway_front(tmp_path, state, up.address) as port:
            base = f"http://127.0.0.1:{port}"

            def status(secret: str) -> int:
                return httpx.post(base + "/v1/chat/completions", json=chat, timeout=10,
                                  headers={"Authorization": f"Bearer {secret}"}).status_code

            _sign_in(driver, base, BUILDER_KEYS["alice"])
            _until(driver, lambda d: "tenant acme · admin" in _text(d, "#who"), "signed in as acme's admin")
            _until(driver, lambda d: len(_attrs(d, "#tenant-keys tbody tr", "data-key")) == 2, "acme's two keys")
            bob = hashlib.sha256(BUILDER_KEYS["bob"].encode()).hexdigest()[:12]
            assert bob not in _attrs(driver, "#tenant-keys tbody tr", "data-key")        # globex's: never listed

            driver.find_element(By.ID, "create-key-name").send_keys("ci-bot")
            driver.find_element(By.ID, "create-key").click()
            _until(driver, lambda d: _text(d, "#new-secret-value").startswith("sk-ace-"), "the new secret shown")
            secret = _text(driver, "#new-secret-value")
            new_id = hashlib.sha256(secret.encode()).hexdigest()[:12]
            _until(driver, lambda d: new_id in _attrs(d, "#tenant-keys tbody tr", "data-key"), "the new key listed")
            assert secret not in _text(driver, "#tenant-keys") and status(secret) == 200
            assert driver.execute_script("return sessionStorage.getItem('ace.key')") == BUILDER_KEYS["alice"]

            assert driver.execute_script(_CLICK, f'#tenant-keys tr[data-key="{new_id}"] button[data-action="rotate"]')
            _until(driver, lambda d: _text(d, "#new-secret-value") not in ("", secret), "the rotated secret shown")
            rotated = _text(driver, "#new-secret-value")
            assert status(secret) == 401 and status(rotated) == 200
            _until(driver, lambda d: _text(d, f'#tenant-keys tr[data-key="{new_id}"] td[data-field="status"]')
                   == "revoked", "the old key listed as revoked")

            carol = hashlib.sha256(BUILDER_KEYS["carol"].encode()).hexdigest()[:12]
            assert driver.execute_script(_CLICK, f'#tenant-keys tr[data-key="{carol}"] button[data-action="revoke"]')
            _until(driver, lambda d: _text(d, f'#tenant-keys tr[data-key="{carol}"] td[data-field="status"]')
                   == "revoked", "carol's key revoked")
            assert status(BUILDER_KEYS["carol"]) == 401 and status(BUILDER_KEYS["alice"]) == 200
            driver.find_element(By.ID, "new-secret-done").click()
            assert _text(driver, "#new-secret-value") == ""
