"""``livestep init [DIR]``: write the deployment files for this livestep into DIR/deploy/.

    livestep init                 # ./deploy/: prometheus/ (config, rules, rule tests), alertmanager/, grafana/, DEPLOY.md
    livestep init /etc/livestep --force

The files are package data (setup.py copies the repo's ``deploy/`` and docs/DEPLOY.md into the wheel
as ``api/deploy/``); in a source checkout they are read in place. Nothing is overwritten unless
``--force``: a file already there stops the command with one line naming it. DEPLOY.md (written
beside them) walks through serve, workers, Prometheus, Alertmanager and Grafana.
"""

from __future__ import annotations

import argparse
import shutil
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class InitError(Exception):
    """``livestep init`` cannot write its files; the message says why."""


def register(subparsers) -> None:
    p = subparsers.add_parser("init", help="write the deployment files (Prometheus, Alertmanager, Grafana) to DIR/deploy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="?", default=".", help="folder to write deploy/ into (default: the working directory)")
    p.add_argument("--force", action="store_true", help="overwrite files that are already there")
    p.set_defaults(func=run)


def deploy_files() -> dict[str, Path]:
    """Relative path -> source file of every deployment file this install ships."""
    packaged = resources.files("api") / "deploy"
    if packaged.is_dir():
        root = Path(str(packaged))
        return {str(f.relative_to(root)): f for f in sorted(root.rglob("*")) if f.is_file()}
    files = {str(f.relative_to(REPO / "deploy")): f for f in sorted((REPO / "deploy").rglob("*")) if f.is_file()}
    if files:
        files["DEPLOY.md"] = REPO / "docs" / "DEPLOY.md"
    return files


def write(target: Path, force: bool = False) -> list[Path]:
    """Copy every deployment file under ``target`` (its ``deploy/``); returns the paths written."""
    files = deploy_files()
    if not files:
        raise InitError("this livestep install has no deployment files (api/deploy/ is missing): reinstall it")
    out = target / "deploy"
    clash = [out / rel for rel in files if (out / rel).exists()]
    if clash and not force:
        raise InitError(f"{clash[0]} exists (and {len(clash) - 1} more); nothing written: pass --force to "
                        "overwrite, or another DIR")
    written = []
    for rel, src in files.items():
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        written.append(dst)
    return written


def run(args: argparse.Namespace) -> int:
    target = Path(args.dir).resolve()
    written = write(target, args.force)
    for p in written:
        print(f"wrote {p}")
    print(f"next: read {target / 'deploy' / 'DEPLOY.md'} (serve, workers, Prometheus, Alertmanager, Grafana); "
          f"check the rules with `promtool test rules {target / 'deploy/prometheus/tests/rules_test.yml'}`")
    return 0
