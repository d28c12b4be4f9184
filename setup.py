"""Build step: the schema (the repo's top-level ``sql/``) ships inside the wheel as ``collector/sql/``,
and the deployment files (``deploy/``: Prometheus, Alertmanager, Grafana, with docs/DEPLOY.md) as
``api/deploy/``, which ``livestep init`` writes out for the user (api/init.py).

Everything else about the package is declared in pyproject.toml. ``sql/`` stays at the top of the
repo (operators read and apply it there); ``collector/migrations.py`` finds the files through
``importlib.resources`` in an installed wheel, and beside the packages in a source checkout.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SQL = ROOT / "sql"
DEPLOY = ROOT / "deploy"


class BuildPyWithSchema(build_py):
    """``build_py`` that also copies ``sql/**/*.sql`` to ``<build_lib>/collector/sql/`` and ``deploy/**``
    to ``<build_lib>/api/deploy/`` (package data)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads sql/ in place
            return
        for f in sorted(SQL.rglob("*.sql")):
            out = Path(self.build_lib) / "collector" / "sql" / f.relative_to(SQL)
            self.mkpath(str(out.parent))
            self.copy_file(str(f), str(out), preserve_mode=False)
        deploy = [(f, f.relative_to(DEPLOY)) for f in sorted(DEPLOY.rglob("*")) if f.is_file()]
        for f, rel in [*deploy, (ROOT / "docs" / "DEPLOY.md", Path("DEPLOY.md"))]:  # the recipe travels too
            out = Path(self.build_lib) / "api" / "deploy" / rel
            self.mkpath(str(out.parent))
            self.copy_file(str(f), str(out), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithSchema})
