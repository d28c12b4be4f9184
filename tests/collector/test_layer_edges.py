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
