"""Render envoy/envoy.template.yaml for a local stack, a test or the benchmark.

``python -m extproc.envoy_config --out envoy.yaml [--listen-port 8080 ...]``
``with_extproc=False`` renders the same Envoy without the ext_proc filter and the filters
that serve it (buffer, body limit): the benchmark baseline.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from string import Template
from typing import Sequence

import yaml

from extproc.domain.headers import hint_header
from extproc.rewrite.hints import HINT_FIELDS

__all__ = ["API_PATHS", "SETTINGS_PATHS", "TEMPLATE", "decimal_at_most", "render"]

TEMPLATE = Path(__file__).resolve().parents[1] / "envoy" / "envoy.template.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"
BUFFER = "envoy.filters.http.buffer"
BODY_LIMIT_FILTERS = ("ace.body_drain", "ace.body_limit")   # Lua: an oversize body is read, then 413
#: the gateway's own API, answered by ext_proc (extproc.app.routes and extproc.app.console
#: register their handlers for exactly these; tests/extproc/test_envoy_config.py checks)
API_PATHS = ("/api/v1/dev_key/skills", "/api/v1/me", "/api/v1/me/skills", "/api/v1/tenant/skills",
             "/api/v1/tenant/keys", "/api/v1/tenant/keys/rotate", "/api/v1/tenant/keys/revoke",
             "/api/v1/adapters", "/api/v1/usage")
#: the settings page's files (extproc.app.console), answered by ext_proc without a key
SETTINGS_PATHS = ("/settings", "/settings/", "/settings/app.js", "/settings/app.css")


def _exact_paths(paths) -> str:
    """An RE2 pattern (Envoy matches it against the whole path) for exactly ``paths``, as a
    YAML double-quoted string (its backslashes doubled)."""
    return "|".join(p.replace(".", "\\\\.") for p in paths)


def _hint_headers() -> str:
    lines = []
    for f in HINT_FIELDS:
        name = hint_header(f)
        lines.append(f'              - header: {{key: {name}, value: "%DYNAMIC_METADATA(ace:hint_{f})%"}}\n'
                     "                append_action: OVERWRITE_IF_EXISTS_OR_ADD")
    return "\n".join(lines)


def _hint_names() -> str:
    return ", ".join(hint_header(f) for f in HINT_FIELDS)


def decimal_at_most(limit: int) -> str:
    """An RE2 pattern matching exactly the decimal numbers 1..``limit`` (no leading zeros):
    the content-lengths whose body fits Envoy's buffer."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    digits = str(limit)
    alternatives = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(int(c) for c in digits):   # same prefix, then a smaller digit here
        low, rest = (1 if i == 0 else 0), len(digits) - i - 1
        if d > low:
            alternatives.append(digits[:i] + (f"[{low}-{d - 1}]" if d - 1 > low else str(low))
                                + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(digits)
    return "(?:" + "|".join(alternatives) + ")"


def _extproc_endpoints(extproc: str | Sequence[str]) -> str:
    replicas = [extproc] if isinstance(extproc, str) else list(extproc)
    if not replicas:
        raise ValueError("at least one ext_proc address (host:port) is needed")
    lines = []
    for address in replicas:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise ValueError(f"ext_proc address must be host:port, got {address!r}")
        lines.append("        - endpoint: {address: {socket_address: "
                     f"{{address: {host}, port_value: {port}}}}}}}")
    return "\n".join(lines)


def render(*, listen_port: int = 8080, admin_port: int = 9901,
           extproc: str | Sequence[str] = "127.0.0.1:50051",
           default_upstream: str = "127.0.0.1:8000", listen_address: str = "0.0.0.0",
           failure_mode_allow: bool = False, message_timeout: str = "1s",
           max_body_bytes: int = 1 << 20, with_extproc: bool = True) -> str:
    """The Envoy config. ``extproc``: one ext_proc ``host:port`` or several (replicas).
    ``failure_mode_allow=True`` is fail-open: with no ext_proc answer, an OpenAI request
    goes on unauthenticated to ``default_upstream`` (docs/gateway.md, "Failure mode")."""
    buffer_limit = max_body_bytes + (64 << 10)
    text = Template(TEMPLATE.read_text()).substitute(
        listen_port=listen_port, admin_port=admin_port, listen_address=listen_address,
        extproc_endpoints=_extproc_endpoints(extproc), default_upstream=default_upstream,
        failure_mode_allow="true" if failure_mode_allow else "false",
        message_timeout=message_timeout, buffer_limit=buffer_limit,
        length_within_buffer=decimal_at_most(buffer_limit),
        hint_headers=_hint_headers(), hint_names=_hint_names(), api_paths=_exact_paths(API_PATHS),
        settings_paths=_exact_paths(SETTINGS_PATHS))
    if with_extproc:
        return text
    config = yaml.safe_load(text)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"]
                           if f["name"] not in (EXT_PROC, BUFFER, *BODY_LIMIT_FILTERS)]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            route.pop("typed_per_filter_config", None)
    return yaml.safe_dump(config, sort_keys=False)


EPP_TEMPLATE = TEMPLATE.with_name("epp.template.yaml")
_TLS_TRANSPORT = """    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: ["h2"]
          validation_context: {}"""
_SUBSET_FILTER = """          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: %s
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true"""


def render_epp(*, listen_port: int = 8081, admin_port: int = 19000, extproc: str = "127.0.0.1:9002",
               listen_address: str = "0.0.0.0", message_timeout: str = "10s", tls: bool = True,
               subset_header: str | None = None, body_mode: str = "FULL_DUPLEX_STREAMED",
               max_body_bytes: int = 1 << 20) -> str:
    """envoy/epp.template.yaml: Envoy as the inference extension's standalone chart sets it
    up in front of ``ace --protocol epp`` at ``extproc`` (TLS unless ``tls=False``).
    ``subset_header``: a request header whose value becomes the subset hint metadata
    (``header_to_metadata``; for tests: a real gateway sets the hint itself). ``body_mode``:
    both bodies' ext_proc mode, ``FULL_DUPLEX_STREAMED`` (the gateways' default) or
    ``BUFFERED`` (Envoy AI Gateway's per-pool option: Envoy then holds the whole body,
    so the connection buffer is ``max_body_bytes`` plus headroom; the chart's 32 KiB else)."""
    if body_mode not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(f"body_mode must be FULL_DUPLEX_STREAMED or BUFFERED, got {body_mode!r}")
    host, sep, port = extproc.rpartition(":")
    if not (sep and host and port.isdigit()):
        raise ValueError(f"ext_proc address must be host:port, got {extproc!r}")
    return Template(EPP_TEMPLATE.read_text()).substitute(
        listen_port=listen_port, admin_port=admin_port, listen_address=listen_address,
        extproc_host=host, extproc_port=port, message_timeout=message_timeout,
        extproc_transport=_TLS_TRANSPORT if tls else "", body_mode=body_mode,
        buffer_limit=32768 if body_mode == "FULL_DUPLEX_STREAMED" else max_body_bytes + (64 << 10),
        health_tls='      tls_options: {alpn_protocols: ["h2"]}' if tls else "",
        subset_filter=_SUBSET_FILTER % subset_header if subset_header else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--listen-port", type=int, default=8080)
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--extproc", default=["127.0.0.1:50051"], nargs="+", metavar="HOST:PORT",
                   help="the ext_proc replicas (one or more host:port)")
    p.add_argument("--upstream", default="127.0.0.1:8000", help="default upstream host:port")
    p.add_argument("--fail-open", action="store_true",
                   help="failure_mode_allow: true. RISK: while no ext_proc answers, OpenAI "
                        "requests reach the default upstream UNAUTHENTICATED (default: 503)")
    p.add_argument("--no-extproc", action="store_true", help="baseline without ext_proc")
    a = p.parse_args()
    a.out.write_text(render(listen_port=a.listen_port, admin_port=a.admin_port, extproc=a.extproc,
                            default_upstream=a.upstream, failure_mode_allow=a.fail_open,
                            with_extproc=not a.no_extproc))


if __name__ == "__main__":
    main()
