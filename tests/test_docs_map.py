"""docs/contracts.md "Where does X happen" names files that exist, and every module is named.

The table says which file owns each decision; "Other modules" lists the rest. Both rot
silently when a module is renamed or added, so this test reads them back: every path they
name must exist (a file, or a directory when written with a trailing ``/``), and every
Python module under ``extproc/`` and ``gpu_agent/`` (not ``__init__``, ``__main__`` or the
generated ``_proto``) must be named in the table, in the list, or sit under a directory
one of them names.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = REPO / "docs" / "contracts.md"
PACKAGES = ("extproc", "gpu_agent")
TABLE_HEADING = "Where does X happen"
OTHER_HEADING = "Other modules"

# A repository path in a cell or a list item: starts with one of the packages, made of
# path characters, optionally ending in "/" (a directory). Backticks, bold, links and
# punctuation around it are not part of it.
_PATH = re.compile(r"(?<![\w./-])((?:%s)(?:/[\w.-]+)+/?|(?:%s)/)" % ("|".join(PACKAGES), "|".join(PACKAGES)))


def _section(text: str, heading: str) -> str:
    """The body of the markdown section whose heading contains ``heading``, up to the next
    heading of the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+)\s+(.*)", line)
        if m and heading.lower() in m.group(2).lower():
            level = len(m.group(1))
            body = []
            for rest in lines[i + 1:]:
                n = re.match(r"(#+)\s", rest)
                if n and len(n.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise AssertionError(f"docs/contracts.md has no section {heading!r}")


def _split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows(text: str) -> list[list[str]]:
    """The data rows of the first table in the "Where does X happen" section."""
    body = _section(text, TABLE_HEADING)
    # Stop at the first subsection: "Other modules" is nested under it.
    body = re.split(r"^#+\s", body, maxsplit=1, flags=re.M)[0]
    rows = [line for line in body.splitlines() if line.lstrip().startswith("|")]
    assert len(rows) >= 3, "the table is missing or empty"
    header, rule, data = rows[0], rows[1], rows[2:]
    assert re.fullmatch(r"[\s|:-]+", rule), f"not a markdown table rule: {rule!r}"
    width = len(_split_row(header))
    parsed = [_split_row(r) for r in data]
    for row in parsed:
        assert len(row) == width, f"row with {len(row)} cells, header has {width}: {row}"
    return parsed


def paths_in(text: str) -> list[str]:
    return [m.rstrip(".") if not m.endswith("/") else m for m in _PATH.findall(text)]


def named_paths(text: str) -> tuple[list[str], list[str], list[str]]:
    """(owners: the second column, every path anywhere in the table, the "Other modules" list)."""
    rows = table_rows(text)
    owners = []
    for row in rows:
        found = paths_in(row[1])
        assert len(found) == 1, f"the owner cell must name exactly one file or directory: {row}"
        owners.append(found[0])
    in_table = [p for row in rows for cell in row for p in paths_in(cell)]
    others = paths_in(_section(text, OTHER_HEADING))
    return owners, in_table, others


def modules() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO)
            if "_proto" in rel.parts or path.name in ("__init__.py", "__main__.py"):
                continue
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            found.append(rel.as_posix())
    return found


def covered(module: str, named: set[str]) -> bool:
    return module in named or any(n.endswith("/") and module.startswith(n) for n in named)


# --- the parser itself (so a formatting change cannot make the checks vacuous) ---

SAMPLE = """# Title

## Where does X happen

| job | owning file | around it |
|---|---|---|
| auth | `extproc/domain/auth.py` | keys |
| rewrite | **`extproc/rewrite/`** | hints: `extproc/rewrite/hints.py`, codec |
| pool | [gpu_agent/engine/pool.py](../gpu_agent/pool.py). | |

### Other modules

- `extproc/protocols/wire.py`: protobuf.
- gpu_agent/engine/model.py, `gpu_agent/connectors/`: engine (the gpu_agent package, `gpu_agent.fixtures`).

## Fixtures
`extproc/never.py` is outside both sections.
"""


def test_parser_reads_backticked_bold_linked_and_bare_paths():
    owners, in_table, others = named_paths(SAMPLE)
    assert owners == ["extproc/domain/auth.py", "extproc/rewrite/", "gpu_agent/engine/pool.py"]
    assert "extproc/rewrite/hints.py" in in_table
    assert others == ["extproc/protocols/wire.py", "gpu_agent/engine/model.py", "gpu_agent/connectors/"]
    assert "extproc/never.py" not in in_table + others


def test_parser_refuses_an_owner_cell_without_exactly_one_path():
    bad = SAMPLE.replace("| `extproc/domain/auth.py` |", "| `extproc/domain/auth.py`, `extproc/x.py` |")
    try:
        named_paths(bad)
    except AssertionError as e:
        assert "exactly one" in str(e)
    else:
        raise AssertionError("two owners in one cell were accepted")


def test_coverage_counts_a_named_directory_and_nothing_else():
    named = {"extproc/domain/auth.py", "gpu_agent/connectors/"}
    assert covered("gpu_agent/connectors/vllm.py", named)
    assert covered("extproc/domain/auth.py", named)
    assert not covered("extproc/auth_extra.py", named)
    assert not covered("gpu_agent/connectorsx/a.py", named)


# --- the real document ---

def test_every_path_the_map_names_exists():
    owners, in_table, others = named_paths(CONTRACTS.read_text())
    assert len(owners) >= 20, f"the table names only {len(owners)} owners"
    missing = []
    for p in dict.fromkeys(in_table + others):
        target = REPO / p.rstrip("/")
        ok = target.is_dir() if p.endswith("/") else target.is_file()
        if not ok:
            missing.append(p)
    assert not missing, f"docs/contracts.md names paths that do not exist: {missing}"


def test_every_module_is_in_the_map_or_the_other_modules_list():
    _, in_table, others = named_paths(CONTRACTS.read_text())
    named = set(in_table) | set(others)
    found = modules()
    assert found, "no modules found: wrong repository root?"
    unnamed = [m for m in found if not covered(m, named)]
    assert not unnamed, ("modules named neither in docs/contracts.md's table nor in its "
                         f"'Other modules' list: {unnamed}")
