"""The collector's edges against the layers (issue 28): collector never imports api, the schema
(migrations) never imports the store that applies it, and the spool's parts import only downward."""

from __future__ import annotations

import ast
from pathlib import Path

COLLECTOR = Path(__file__).resolve().parents[2] / "collector"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local and TYPE_CHECKING imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_no_collector_module_imports_api():
    bad = {p.name: sorted(m for m in _imports(p) if m == "api" or m.startswith("api."))
           for p in COLLECTOR.glob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_migrations_do_not_import_the_store():
    assert "collector.store" not in _imports(COLLECTOR / "migrations.py")


def test_no_collector_module_reaches_into_anothers_private_state():
    """The spool's queue, storage and sender (and every other collector module) use each other's public
    names only: no ``other._name`` attribute, no ``from x import _name`` (``writer.py`` once waited on
    ``spool._cond``)."""
    bad = []
    for p in sorted(COLLECTOR.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{p.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("collector"):
                bad += [f"{p.name}:{node.lineno} imports {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []
