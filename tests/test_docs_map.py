"""docs/contracts.md "Where does X happen" names files that exist, and every module is named.

The table says which file owns each decision; "Other modules" lists the rest. Both rot
silently when a module is renamed or added, so this test reads them back: every path they
name must exist (a file, or a directory when written with a trailing ``/``), and every
Python module under ``extproc/``, ``gpu_agent/`` and ``ace_common/`` (not ``__init__``,
``__main__`` or the generated ``ace_common/proto``) must be named in the table, in the list,
or sit under a directory one of them names. No decision's owner sits under the transport or
protocol layers (they translate, never decide).

"Folders" maps each folder (and each layer that is a module) to what it owns: it names
exactly the package's folders, and its order is the import-linter layers' order.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = REPO / "docs" / "contracts.md"
PACKAGES = ("ace_common", "extproc", "gpu_agent")
GENERATED = "ace_common/proto/"
#: folders that translate and never decide: no owner of the table sits under them
NO_DECISIONS = ("extproc/transport/", "extproc/protocols/")
FOLDERS_HEADING = "Folders"
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
            if rel.as_posix().startswith(GENERATED) or path.name in ("__init__.py", "__main__.py"):
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


def test_no_decision_is_owned_by_the_transport_or_protocol_layers():
    owners, _, _ = named_paths(CONTRACTS.read_text())
    assert [o for o in owners if o.startswith(NO_DECISIONS)] == []


def folder_rows(text: str) -> list[str]:
    """The first column of the "Folders" table, one path each."""
    body = re.split(r"^#+\s", _section(text, FOLDERS_HEADING), maxsplit=1, flags=re.M)[0]
    rows = [_split_row(line) for line in body.splitlines() if line.lstrip().startswith("|")][2:]
    out = []
    for row in rows:
        found = paths_in(row[0])
        assert len(found) == 1, f"a folder row names exactly one path: {row}"
        out.append(found[0])
    return out


def _tree_folders() -> set[str]:
    """Every package folder of the three packages (the generated protos' inner folders aside)."""
    found = set()
    for package in PACKAGES:
        for init in (REPO / package).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO).as_posix() + "/"
            if rel.startswith(GENERATED) and rel != GENERATED:
                continue
            found.add(rel)
    return found


def _layers() -> dict[str, list[str]]:
    """container -> its layers' paths, top first, from pyproject.toml's import-linter contracts."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    out = {}
    for c in config["contracts"]:
        if c["type"] == "layers":
            (container,) = c["containers"]
            folder = container.replace(".", "/")   # a nested container: gpu_agent.residency
            paths = []
            for layer in c["layers"]:
                for name in (n.strip() for n in re.split(r"[|:]", layer)):
                    base = REPO / folder / name
                    paths.append(f"{folder}/{name}/" if base.is_dir() else f"{folder}/{name}.py")
            out[container] = paths
    return out


def test_the_folders_table_is_the_tree():
    listed = folder_rows(CONTRACTS.read_text())
    assert len(listed) == len(set(listed)), "a folder is listed twice"
    folders = {p for p in listed if p.endswith("/")}
    assert folders == _tree_folders(), (f"in the tree, not in the table: {sorted(_tree_folders() - folders)}; "
                                        f"in the table, not in the tree: {sorted(folders - _tree_folders())}")
    missing = [p for p in listed if not (REPO / p.rstrip("/")).exists()]
    assert not missing


def test_the_folders_table_lists_the_layers_in_the_contracts_order():
    listed = folder_rows(CONTRACTS.read_text())
    for container, layers in _layers().items():
        assert all(layer in listed for layer in layers), (container, [x for x in layers if x not in listed])
        positions = [listed.index(layer) for layer in layers]
        assert positions == sorted(positions), f"{container}: the table's order is not the layers' order"


_DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES))


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module, or a module's attribute (``extproc.policy.routing.pick_order``)."""
    import importlib
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_docs_name_only_modules_and_paths_that_exist():
    """After a move, no page names a module, a module's name or a file that is gone."""
    stale = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        stale += [f"{page.name}: {d}" for d in sorted(set(_DOTTED.findall(text))) if not _resolves(d.rstrip("."))]
        stale += [f"{page.name}: {p}" for p in sorted(set(paths_in(text)))
                  if not (REPO / p.rstrip("/")).exists() and "*" not in p]
    assert not stale


TEST_MAP = REPO / "tests" / "README.md"
_TEST_PATH = re.compile(r"(?<![\w./-])(tests(?:/[\w.-]+)+/?)")


def test_the_test_map_names_every_test_file_and_only_files_that_exist():
    """tests/README.md says which layer each test file tests: it names every test file
    (or a folder it sits in), and nothing that is gone."""
    named = {m.rstrip(".") if not m.endswith("/") else m for m in _TEST_PATH.findall(TEST_MAP.read_text())}
    gone = sorted(p for p in named if not (REPO / p.rstrip("/")).exists())
    assert not gone, f"tests/README.md names paths that do not exist: {gone}"
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))
    assert files, "no test files found"
    unnamed = [f for f in files if not covered(f, named)]
    assert not unnamed, f"test files tests/README.md does not name: {unnamed}"
