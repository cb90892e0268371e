"""What the import-linter contracts (pyproject.toml, tests/test_import_contracts.py) cannot
say: typing-only imports name what exists, one error root, header names spelled once, the
phase dispatch written once, no cycle between the exchange and its route handlers.

Read from the source with ``ast``: an import under ``if TYPE_CHECKING:`` is for annotations
only and does not count as a dependency (it must still name something that exists)."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import extproc
from extproc.errors import AceError

PACKAGE = Path(extproc.__file__).parent


def _typing_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, typing: bool = False):
    """(module, names, typing-only) for every import in ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), typing
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:   # ``from extproc.app import exchange`` imports extproc.app.exchange
                sub = f"{node.module}.{alias.name}"
                if node.module == "extproc":
                    yield sub, (), typing
                else:
                    yield node.module, (alias.name,), typing
        else:
            yield from _imports(node, typing or _typing_only(node))


def _runtime(path: Path) -> set[str]:
    return {mod for mod, _, typing in _imports(ast.parse(path.read_text())) if not typing}


def test_phase_dispatch_is_written_once():
    """Only the dispatcher (and the endpoint picker protocol it serves) reads the phase of
    a ProcessingRequest: the servers are transports."""
    for name in ("grpc_servers", "h2server", "h2calls"):
        assert "WhichOneof" not in (PACKAGE / "transport" / f"{name}.py").read_text(), name


def _all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "extproc.")
                  if m.name != "extproc.__main__")


def test_typing_only_imports_name_what_exists():
    """A typing-only import is not run, so a rename would leave it stale unnoticed."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for mod, names, typing in _imports(ast.parse(path.read_text())):
            if typing and mod.startswith("extproc"):
                module = importlib.import_module(mod)
                for n in names:
                    assert hasattr(module, n), f"{path.name}: {mod}.{n} does not exist"


def test_every_gateway_error_has_one_root():
    """Every exception class of extproc derives from ``extproc.errors.AceError``."""
    strays = []
    for name in _all_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (cls.__module__ == name and issubclass(cls, BaseException)
                    and not issubclass(cls, AceError)):
                strays.append(f"{name}.{cls.__name__}")
    assert not strays


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_gateway_header_names_are_spelled_once():
    """Every ``x-ace-*`` header name in code comes from extproc.domain.headers."""
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "headers.py":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        spelled += [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "x-ace-" in node.value and id(node) not in docs]
    assert not spelled


@pytest.mark.parametrize("name", ("handlers", "console", "inference", "dev_key_skills", "model_list"))
def test_route_handlers_beside_the_exchange_do_not_import_it(name):
    """The exchange picks handlers from the route table built of these modules; an import back
    (of the exchange, the table or the context that opens exchanges) would be a cycle."""
    imported = _runtime(PACKAGE / "app" / f"{name}.py")
    assert not imported & {"extproc.app.exchange", "extproc.app.routes", "extproc.app.context"}
