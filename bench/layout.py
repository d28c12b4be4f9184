"""Issue 28's goals, measured on the tree: where SQL lives, how far a step field travels, large modules,
edges against the layers, duplicate pairs. Prints a table for HEAD's working tree and for a baseline
commit measured in the same run, and last the ratios (now / baseline).

    python bench/layout.py                    # against 64eeb50 (the review of issue 28)
    python bench/layout.py --baseline main

- modules holding SQL: .py files outside tests/ and bench/ with a string (docstrings aside) that is a
  SQL statement (SELECT ... FROM, INSERT INTO, ALTER/CREATE/DROP TABLE|DATABASE|VIEW, OPTIMIZE TABLE) or
  that call the store's query methods (query_df, query_rows, query_arrow, command);
- a step field's way: .py and .sql files outside tests/, bench/ and docs that name ``cache_upkeep_ms``
  or the per-session column it becomes (``upkeep_ms``): the record, the view, the read layer, the
  detectors, the charts;
- modules over 450 lines (api/, analytics/, collector/, worker/, kernels/);
- layer edges: api importing a private name of analytics (``_x``), an api module (outside the app
  factory) importing a router module, analytics or collector importing api;
- duplicate pairs: the ``duplicates`` tool's count over the tree (6+ shared lines).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "analytics", "collector", "worker", "kernels")
_STATEMENT = re.compile(r"(?s)\bSELECT\b.+\bFROM\b|\bINSERT INTO\b|\b(ALTER|CREATE|DROP)\s+(TABLE|DATABASE|"
                        r"MATERIALIZED VIEW|VIEW)\b|\bOPTIMIZE TABLE\b")
_CALLS = {"query_df", "query_rows", "query_arrow", "command"}
_FIELD = re.compile(r"\b(cache_upkeep_ms|upkeep_ms)\b")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def holds_sql(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CALLS:
            return True
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        if text and _STATEMENT.search(text):
            return True
    return False


def sources(root: Path) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def layer_edges(root: Path) -> list[str]:
    out = []
    for p in sources(root):
        rel = p.relative_to(root).as_posix()
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                mods, names = [a.name for a in node.names], []
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if rel.startswith("api/") and top == "analytics" and any(n.startswith("_") for n in names):
                    out.append(f"{rel}: private {m}.{[n for n in names if n.startswith('_')]}")
                if (rel.startswith("api/") and rel != "api/app.py" and
                        (m.startswith("api.routes.") and not m.endswith("._common")
                         or (m == "api.routes" and any(n != "_common" for n in names)))):
                    out.append(f"{rel}: router as a library {m} {names}")
                if rel.split("/")[0] in ("analytics", "collector") and top == "api":
                    out.append(f"{rel}: imports {m}")
    return out


def duplicate_pairs(root: Path) -> str:
    try:
        r = subprocess.run(["duplicates", "--repo", str(root), "--most", "1", "--seconds", "120"],
                           capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"n/a ({e.__class__.__name__})"
    first = (r.stdout.strip().splitlines() or ["n/a"])[0]
    m = re.match(r"(\d+) pairs?", first)
    return m.group(1) if m else ("0" if first.startswith("no duplicates") else first)


def measure(root: Path) -> dict[str, object]:
    py = sources(root)
    sql_modules = [p.relative_to(root).as_posix() for p in py if holds_sql(p)]
    way = sorted(p.relative_to(root).as_posix() for p in [*py, *sorted((root / "sql").rglob("*.sql"))]
                 if _FIELD.search(p.read_text()))
    big = sorted((len(p.read_text().splitlines()), p.relative_to(root).as_posix()) for p in py)
    big = [f"{p} ({n})" for n, p in big if n > 450]
    return {"modules holding SQL": sql_modules, "a step field's way (files)": way,
            "modules over 450 lines": big, "layer edges": layer_edges(root),
            "duplicate pairs": duplicate_pairs(root)}


def checkout(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    subprocess.run(["git", "init", "-q", str(into)], check=True)  # duplicates reads a git checkout's tracked files
    subprocess.run(["git", "-C", str(into), "add", "-A"], check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="64eeb50", help="a commit to compare with (default 64eeb50)")
    ap.add_argument("--list", action="store_true", help="also list the files behind each count")
    args = ap.parse_args(argv)
    now = measure(REPO)
    with tempfile.TemporaryDirectory() as tmp:
        base = measure(checkout(args.baseline, Path(tmp)))
    count = {k: (len(v) if isinstance(v, list) else v) for k, v in now.items()}
    bcount = {k: (len(v) if isinstance(v, list) else v) for k, v in base.items()}
    print(f"{'goal':<30} {args.baseline:>10} {'now':>6}")
    for k in now:
        print(f"{k:<30} {bcount[k]!s:>10} {count[k]!s:>6}")
    if args.list:
        for k, v in now.items():
            if isinstance(v, list):
                print(f"\n{k} (now):\n  " + "\n  ".join(v))
    print()
    for k in now:
        try:
            print(f"ratio now/{args.baseline} {k}: {int(count[k]) / int(bcount[k]):.2f}")
        except (ValueError, ZeroDivisionError):
            print(f"ratio now/{args.baseline} {k}: n/a")
    return 0


if __name__ == "__main__":
    sys.exit(main())
