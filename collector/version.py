"""livestep's version, declared once: pyproject.toml reads it (``dynamic = ["version"]``), ``livestep
--version`` prints it, the API's OpenAPI document carries it. Dependency-free (the worker imports it)."""

__version__ = "0.2.0"
