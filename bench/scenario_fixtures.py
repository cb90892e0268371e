"""The adapters a trace needs, for the tiny fixtures model, made once and kept.

    python -m bench.scenario_fixtures TRACE [--fixtures .fixtures] [--cache var/bench-fixtures]

The committed fixtures (``python -m gpu_agent.fixtures``) hold 10 adapters; a scenario
such as ``hundreds`` names 200+. ``trace_catalog`` returns the committed catalog when
it has every adapter the trace names at its rank; otherwise the catalog of a fixtures
directory under ``--cache`` made for exactly that set of (name, rank) pairs: the
committed model, and one PEFT adapter per name drawn from ``gpu_agent.fixtures``'
per-name seed (so the same name and rank are the same bytes in every trace and on every
machine). The directory is named by a digest of the set, written beside and renamed
into place when complete, so a second run (or another trace over the same adapters)
makes nothing. 226 adapters of ranks 8-128 are about 60 MB and a few seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from gpu_agent.catalog_schema import read_catalog_file

__all__ = ["DEFAULT_CACHE", "trace_catalog", "wanted_adapters"]

DEFAULT_CACHE = Path("var/bench-fixtures")


def wanted_adapters(requests: list[dict]) -> dict[str, tuple[int, str]]:
    """adapter -> (rank, domain), first seen first (the trace loader checked one rank each)."""
    wanted: dict[str, tuple[int, str]] = {}
    for r in requests:
        wanted.setdefault(r["adapter"], (r["rank"], r["domain"]))
    return wanted


def trace_catalog(requests: list[dict], fixtures: Path, cache: Path = DEFAULT_CACHE, log=None) -> Path:
    """The catalog (``catalog.yaml``) holding every adapter of ``requests`` at its rank."""
    from gpu_agent.fixtures import AdapterDef, catalog_entry, make_adapter, write_catalog, write_model

    wanted = wanted_adapters(requests)
    committed = fixtures / "catalog.yaml"
    if committed.exists():
        have = {a.name: a.rank for a in read_catalog_file(committed).adapters}
        if all(have.get(name) == rank for name, (rank, _) in wanted.items()):
            return committed
    key = hashlib.sha256(json.dumps(sorted((n, r) for n, (r, _) in wanted.items())).encode()).hexdigest()[:16]
    out = cache / key
    if (out / "catalog.yaml").exists():
        return out / "catalog.yaml"
    if log:
        log(f"making {len(wanted)} fixture adapters under {out} (once)")
    tmp = cache / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = fixtures / "model"
    if (model / "config.json").exists():
        shutil.copytree(model, tmp / "model")
    else:
        write_model(tmp / "model")
    entries = []
    for name, (rank, domain) in sorted(wanted.items()):
        defn = AdapterDef(name, rank, domain, "public")
        entries.append(catalog_entry(defn, make_adapter(tmp / "adapters", name, rank, alpha=defn.alpha)))
    write_catalog(tmp, entries)
    try:
        tmp.rename(out)
    except OSError:  # another run finished first: its directory is the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "catalog.yaml"


def main(argv=None) -> int:
    from bench.trace import TraceError, load_trace

    ap = argparse.ArgumentParser(prog="python -m bench.scenario_fixtures", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="trace file (docs/trace-format.md)")
    ap.add_argument("--fixtures", default=".fixtures", help="the committed fixtures (python -m gpu_agent.fixtures)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="where made fixtures are kept")
    args = ap.parse_args(argv)
    try:
        requests = load_trace(args.trace)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(trace_catalog(requests, Path(args.fixtures), Path(args.cache), log=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
