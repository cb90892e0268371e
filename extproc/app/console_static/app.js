// The ace settings page: plain JS, no build step, no third-party code.
// The API key lives in sessionStorage only (this tab) and goes out as
// "Authorization: Bearer" on fetch(); never in a URL, a cookie or a log.
"use strict";

const STORE = "ace.key";
const SKILLS = ["multi_lora", "dynamic_lora_prefetch"];
const MODES = ["off", "shadow", "prod"];
const REFRESH_MS = 2000;
let timer = null;
let writeError = null;   // the last write's failure: shown until a write succeeds or sign-out

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || "";
  }
}

async function api(path, body) {
  const key = sessionStorage.getItem(STORE);
  const init = { headers: { Authorization: "Bearer " + key }, cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, { error: { message: "the gateway did not answer", code: "network" } });
  }
  const parsed = await resp.json().catch(() => null);
  if (!resp.ok) throw new ApiError(resp.status, parsed);
  return parsed;
}

function showError(e) {
  const box = $("error");
  if (!e) { box.hidden = true; box.textContent = ""; box.removeAttribute("data-status"); return; }
  let text;
  if (e.status === 401) text = "401: this key was refused (revoked or unknown). Sign in again with a valid key.";
  else if (e.status === 503 && e.code === "store_unavailable") text = "503: the gateway's state store is unavailable; nothing was changed. Try again shortly.";
  else if (e.status === 503) text = "503: the gateway is unavailable (" + e.message + ").";
  else if (e.status === 403) text = "403: not allowed for this key (" + e.message + ").";
  else if (e.status === 0) text = "The gateway did not answer.";
  else text = e.status + ": " + e.message;
  box.textContent = text;
  box.setAttribute("data-status", String(e.status));
  box.hidden = false;
}

function modeSelect(scope, skill, current, onChange) {
  const sel = el("select", { "data-scope": scope, "data-skill": skill, id: `set-${scope}-${skill}` });
  // "(not set)" removes this layer's runtime setting (the API's null): the next layer decides
  const unset = current === null || current === undefined;
  sel.append(el("option", { value: "", selected: unset }, "(not set)"));
  for (const m of MODES) sel.append(el("option", { value: m, selected: m === current }, m));
  sel.addEventListener("change", () => onChange(skill, sel.value || null));
  return sel;
}

function renderKey(me) {
  $("who").textContent = `${me.key.name || me.key.id} · tenant ${me.tenant} · ${me.key.role}`;
  const body = $("key-skills").tBodies[0];
  body.replaceChildren();
  for (const skill of SKILLS) {
    const s = me.key.skills[skill];
    body.append(el("tr", {},
      el("td", {}, skill),
      el("td", { id: `key-${skill}-effective` }, s.effective),
      el("td", { id: `key-${skill}-source`, class: "src" }, s.source),
      el("td", {}, modeSelect("key", skill, s.key, (k, v) => write("/api/v1/me/skills", k, v)))));
  }
}

function day(iso) { return iso ? iso.slice(0, 10) : "–"; }

function keyStatus(k) { return k.revoked ? "revoked" : k.expired ? "expired" : "active"; }

function renderTenant(t, keys, me) {
  const body = $("tenant-skills").tBodies[0];
  body.replaceChildren();
  for (const skill of SKILLS) {
    body.append(el("tr", {},
      el("td", {}, skill),
      el("td", { id: `tenant-${skill}-effective` }, t.effective[skill]),
      el("td", {}, modeSelect("tenant", skill, t.skills[skill], (k, v) => write("/api/v1/tenant/skills", k, v))),
      el("td", { class: "src" }, t.default[skill] || "(off)")));
  }
  const kb = $("tenant-keys").tBodies[0];
  kb.replaceChildren();
  for (const k of keys.keys) {
    const actions = el("td", {});
    if (!k.revoked) {
      const rotate = el("button", { type: "button", "data-action": "rotate" }, "Rotate");
      rotate.addEventListener("click", () => keyChange("/api/v1/tenant/keys/rotate", k, me));
      const revoke = el("button", { type: "button", "data-action": "revoke" }, "Revoke");
      revoke.addEventListener("click", () => keyChange("/api/v1/tenant/keys/revoke", k, me));
      actions.append(rotate, " ", revoke);
    }
    kb.append(el("tr", { "data-key": k.id, class: k.revoked ? "revoked" : "" },
      el("td", {}, k.name), el("td", { class: "src" }, k.id), el("td", {}, k.role),
      ...SKILLS.map((s) => el("td", {}, `${k.skills[s].effective} `, el("span", { class: "src" }, `(${k.skills[s].source})`))),
      el("td", { class: "src" }, day(k.created)), el("td", { class: "src" }, day(k.expires)),
      el("td", { "data-field": "status" }, keyStatus(k)), actions));
  }
}

// a secret is in the page only here, until "Done" or sign-out; never stored
function showSecret(what, secret) {
  $("new-secret-what").textContent = what;
  $("new-secret-value").textContent = secret;
  $("new-secret").hidden = false;
}

function hideSecret() {
  $("new-secret-value").textContent = "";
  $("new-secret").hidden = true;
}

async function keyChange(path, k, me) {
  try {
    const out = await api(path, { id: k.id });
    writeError = null;
    if (out.secret) {
      // rotating the key this page signed in with: sign in with its successor
      if (k.id === me.key.id) sessionStorage.setItem(STORE, out.secret);
      showSecret(`New secret for ${k.name || k.id} (id ${out.key.id})`, out.secret);
    }
  } catch (e) {
    writeError = e;
  }
  await load();
}

async function createKey() {
  const expires = $("create-key-expires").value;
  const body = { name: $("create-key-name").value.trim(), role: $("create-key-role").value,
    expires: expires ? expires + "T00:00:00Z" : null };
  try {
    const out = await api("/api/v1/tenant/keys", body);
    writeError = null;
    $("create-key-name").value = "";
    showSecret(`New key ${out.key.name || out.key.id} (id ${out.key.id})`, out.secret);
  } catch (e) {
    writeError = e;
  }
  await load();
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// requests (grey) and effective hits (green) per minute, the current minute on the right
function chart(name, series) {
  const W = 240, H = 44, n = series.requests.length, bw = W / n;
  const max = Math.max(1, ...series.requests);
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img",
    "data-adapter": name, "aria-label": `${name}: requests and effective hits per minute, last ${n} minutes` });
  root.append(svg("line", { x1: 0, y1: H - 0.5, x2: W, y2: H - 0.5, class: "axis" }));
  series.requests.forEach((r, i) => {
    if (!r) return;
    const h = (r / max) * (H - 2), hh = (series.hits[i] / max) * (H - 2);
    const bar = svg("rect", { x: i * bw + 0.5, y: H - h, width: Math.max(1, bw - 1), height: h, class: "req" });
    bar.append(svg("title", {}));
    bar.firstChild.textContent = `${r} requests, ${series.hits[i]} hits`;
    root.append(bar);
    if (hh) root.append(svg("rect", { x: i * bw + 0.5, y: H - hh, width: Math.max(1, bw - 1), height: hh, class: "hit" }));
  });
  return root;
}

function fmtMs(v) { return v === null || v === undefined ? "–" : String(v); }

function renderAdapters(ad, usage) {
  const body = $("adapters").tBodies[0];
  body.replaceChildren();
  for (const a of ad.adapters) {
    const u = usage.adapters[a.name];
    const tiers = el("td", { "data-adapter": a.name, "data-field": "residency" });
    for (const [host, r] of Object.entries(a.residency)) {
      tiers.append(el("span", { class: `tier tier-${r.tier}`, title: r.cold_load_ms === null ? host : `${host}: cold load ${r.cold_load_ms} ms`,
        "data-host": host }, `${host}: ${r.tier}${r.prefetched ? " (prefetched)" : ""}`));
    }
    const t = u.totals, st = u.expected_stall_ms;
    const cell = (field, text) => el("td", { "data-adapter": a.name, "data-field": field }, text);
    body.append(el("tr", { "data-adapter": a.name },
      el("td", {}, a.name, el("div", { class: "src" }, `rank ${a.rank} · ${a.owner}`)),
      tiers,
      cell("requests", t.requests),
      cell("hits", t.hits),
      cell("hit-ratio", u.effective_hit_ratio === null ? "–" : (100 * u.effective_hit_ratio).toFixed(1) + "%"),
      cell("stall", `${fmtMs(st.p50)} / ${fmtMs(st.p90)} / ${fmtMs(st.p99)}`),
      cell("prefetch", `${t.prefetch_used} / ${u.prefetch_unused}`),
      el("td", {}, chart(a.name, u.per_minute))));
  }
}

async function write(path, skill, mode) {
  try {
    await api(path, { skills: { [skill]: mode } });
    writeError = null;
  } catch (e) {
    writeError = e;
  }
  await load();
}

async function load() {
  try {
    const me = await api("/api/v1/me");
    $("signin-section").hidden = true;
    $("app").hidden = false;
    $("who").hidden = false;
    $("signout").hidden = false;
    renderKey(me);
    const admin = me.key.role === "admin";
    $("tenant-section").hidden = !admin;
    const [ad, usage, tenant, keys] = await Promise.all([
      api("/api/v1/adapters"), api("/api/v1/usage?window=3600"),
      admin ? api("/api/v1/tenant/skills") : null, admin ? api("/api/v1/tenant/keys") : null]);
    if (admin) renderTenant(tenant, keys, me);
    renderAdapters(ad, usage);
    showError(writeError);
  } catch (e) {
    showError(e);
    if (e.status === 401) stop(false);
  }
}

function start() {
  load();
  if (timer === null) timer = setInterval(() => { if (!document.hidden) load(); }, REFRESH_MS);
}

function stop(clearError) {
  if (timer !== null) { clearInterval(timer); timer = null; }
  sessionStorage.removeItem(STORE);
  writeError = null;
  hideSecret();
  $("app").hidden = true;
  $("who").hidden = true;
  $("signout").hidden = true;
  $("signin-section").hidden = false;
  if (clearError) showError(null);
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("signin-key").value.trim();
    $("signin-key").value = "";
    if (!key) return;
    sessionStorage.setItem(STORE, key);
    start();
  });
  $("signout").addEventListener("click", () => stop(true));
  $("refresh").addEventListener("click", () => load());
  $("create-key-form").addEventListener("submit", (ev) => { ev.preventDefault(); createKey(); });
  $("new-secret-done").addEventListener("click", hideSecret);
  if (sessionStorage.getItem(STORE)) start();
});
