"""Optional filters as one parameterized WHERE clause: every query of the form "rows of this, if given".

    w = Where().eq("switch", switch).eq("changed", changed, "Bool").since("ts", start).until("ts", end)
    store.query_df(f"SELECT ... FROM t WHERE {w}", w.params)        # "1" when no filter is given

A filter whose value is None (or an empty string) is left out; every value travels as a server-side
parameter (``{name:Type}``), never in the SQL text. Time bounds are half-open: ``since`` inclusive,
``until`` exclusive, as every range in the API (api/routes/_common.py's ``TimeRange``).
"""

from __future__ import annotations

from typing import Any

_TS = "DateTime64(3, 'UTC')"


class Where:
    """The conjunction of the filters given so far, and their parameters (``params``)."""

    def __init__(self, **params: Any):
        self.parts: list[str] = []
        self.params: dict[str, Any] = dict(params)  # e.g. limit/offset, which the query uses too

    def _param(self, col: str, value: Any) -> str:
        name = f"w_{col}"
        i = 1
        while name in self.params:
            i += 1
            name = f"w_{col}_{i}"
        self.params[name] = value
        return name

    @staticmethod
    def _given(value: Any) -> bool:
        return value is not None and value != ""

    def eq(self, col: str, value: Any, type_: str = "String") -> Where:
        if self._given(value):
            self.parts.append(f"{col} = {{{self._param(col, value)}:{type_}}}")
        return self

    def any_of(self, col: str, values, type_: str = "String") -> Where:
        if values:
            self.parts.append(f"{col} IN {{{self._param(col, list(values))}:Array({type_})}}")
        return self

    def since(self, col: str, t) -> Where:
        if t is not None:
            self.parts.append(f"{col} >= {{{self._param(col, t)}:{_TS}}}")
        return self

    def until(self, col: str, t) -> Where:
        if t is not None:
            self.parts.append(f"{col} < {{{self._param(col, t)}:{_TS}}}")
        return self

    def overlapping(self, lo_col: str, hi_col: str, start, end) -> Where:
        """Rows whose interval [lo_col, hi_col) overlaps [start, end) (either bound may be None)."""
        if start is not None:
            self.parts.append(f"{hi_col} > {{{self._param(hi_col, start)}:{_TS}}}")
        if end is not None:
            self.parts.append(f"{lo_col} < {{{self._param(lo_col, end)}:{_TS}}}")
        return self

    def sql(self, text: str, **params: Any) -> Where:
        """A condition of the caller's own, with its parameters."""
        self.parts.append(text)
        self.params.update(params)
        return self

    def __str__(self) -> str:
        return " AND ".join(self.parts) if self.parts else "1"
