"""Build step: the schema (the repo's top-level ``sql/``) ships inside the wheel as ``collector/sql/``.

Everything else about the package is declared in pyproject.toml. ``sql/`` stays at the top of the
repo (operators read and apply it there); ``collector/migrations.py`` finds the files through
``importlib.resources`` in an installed wheel, and beside the packages in a source checkout.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SQL = Path(__file__).resolve().parent / "sql"


class BuildPyWithSchema(build_py):
    """``build_py`` that also copies ``sql/**/*.sql`` to ``<build_lib>/collector/sql/`` (package data)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads sql/ in place
            return
        for f in sorted(SQL.rglob("*.sql")):
            out = Path(self.build_lib) / "collector" / "sql" / f.relative_to(SQL)
            self.mkpath(str(out.parent))
            self.copy_file(str(f), str(out), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithSchema})
