"""Evaluation reads (``livestep evaluate``'s records, kind ``evaluation``):

    GET /v1/evaluations?switch=fp8_cache&gpu_kind=NVIDIA%20H200&release=v7&metric=divergence
        rows, newest first (filters: switch, gpu_kind, release, metric, verdict, evaluation_id, start/end)
    GET /v1/evaluations/latest?release=v7
        the newest overall verdict per switch, GPU kind and release: the evidence the gate on numeric
        switch defaults reads (api/evaluation_gate.py)

An unknown switch, metric or verdict is a 422 naming the valid ones.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from analytics import queries as aq
from api import evaluation_gate
from api.deps import ReaderDep, StoreDep
from api.routes._common import Label, OptionalRangeDep, PageDep
from collector.records import EVALUATED, EVALUATION_METRICS, EVALUATION_VERDICTS

router = APIRouter(prefix="/v1/evaluations", tags=["evaluations"])



def _one_of(name: str, value: str | None, valid: tuple[str, ...]) -> None:
    if value is not None and value not in valid:
        raise HTTPException(422, detail=f"unknown {name} {value!r}; valid: {', '.join(valid)}")


@router.get("")
def list_evaluations(
    store: StoreDep,
    _auth: ReaderDep,
    page: PageDep,
    tr: OptionalRangeDep,
    switch: Annotated[str | None, Query(max_length=64, description="a numeric switch or production")] = None,
    gpu_kind: Label = None,
    release: Label = None,
    metric: Annotated[str | None, Query(max_length=64)] = None,
    verdict: Annotated[str | None, Query(max_length=32)] = None,
    evaluation_id: Label = None,
) -> dict[str, Any]:
    _one_of("switch", switch, EVALUATED)
    _one_of("metric", metric, EVALUATION_METRICS)
    _one_of("verdict", verdict, EVALUATION_VERDICTS)
    rows = aq.evaluation_rows(store, switch=switch, gpu_kind=gpu_kind, release=release, metric=metric, verdict=verdict,
                 evaluation_id=evaluation_id, start=tr.start, end=tr.end, limit=page.limit, offset=page.offset)
    return {"evaluations": rows, "limit": page.limit, "offset": page.offset}


@router.get("/latest")
def latest(store: StoreDep, _auth: ReaderDep, switch: Annotated[str | None, Query(max_length=64)] = None,
           gpu_kind: Label = None, release: Label = None) -> dict[str, Any]:
    _one_of("switch", switch, EVALUATED)
    return {"latest": evaluation_gate.evaluations(store, switch, gpu_kind, release)}
