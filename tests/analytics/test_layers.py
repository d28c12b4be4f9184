"""The layers: the analytics never import the api (the api imports the analytics; the weekly report's
HTML is the api's, registered with the analytics' schedule as a writer). Checked on the source, every
import statement of every analytics module, wherever it sits (a lazy import inside a function counts)."""

from __future__ import annotations

import ast
from pathlib import Path

import analytics

ANALYTICS = Path(analytics.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_no_analytics_module_imports_the_api():
    offenders = {p.name: sorted(m for m in imported_modules(p) if m == "api" or m.startswith("api."))
                 for p in sorted(ANALYTICS.glob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_a_lazy_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from api.settings import get_settings\n")
    assert "api.settings" in imported_modules(f)
