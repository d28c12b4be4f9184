"""Evaluation reads (``livestep evaluate``'s records, kind ``evaluation``):

    GET /v1/evaluations?switch=fp8_cache&gpu_kind=NVIDIA%20H200&release=v7&metric=divergence
        rows, newest first (filters: switch, gpu_kind, release, metric, verdict, evaluation_id, start/end)
    GET /v1/evaluations/latest?release=v7
        the newest overall verdict per switch, GPU kind and release: the evidence the gate on numeric
        switch defaults reads (api/evaluation_gate.py)

    POST /v1/evaluations   (an evaluator token: LIVESTEP_EVALUATOR_TOKENS, never the ingest token)
        body: ``livestep evaluate --out``'s JSON (its measured series); the server judges the series
        itself (worker/evaluate.py ``judge``: a posted verdict is never taken), stamps the evaluator's
        name and stores the records: 201 {evaluation_id, rows, overall}

An unknown switch, metric or verdict is a 422 naming the valid ones.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, HTTPException, Query

from analytics import queries as aq
from api import evaluation_gate
from api.deps import Authorization, ReaderDep, SettingsDep, StoreDep
from api.routes._common import Label, OptionalRangeDep, PageDep
from api.switchboard import get_switchboard
from collector.auth import bearer_token
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


def require_evaluator(settings: SettingsDep, authorization: Authorization = None) -> str:
    """The evaluator's name for its bearer token (LIVESTEP_EVALUATOR_TOKENS); never open: 401/403."""
    token = bearer_token(authorization)
    if token is None:
        raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <evaluator token>' "
                                 "(one of LIVESTEP_EVALUATOR_TOKENS)", headers={"WWW-Authenticate": "Bearer"})
    for name, t in settings.evaluator_tokens.items():
        if hmac.compare_digest(token.encode(), t.encode()):
            return name
    raise HTTPException(403, "the bearer token is not allowed here: this needs an evaluator token (one of "
                             "LIVESTEP_EVALUATOR_TOKENS); ingest, read and admin tokens cannot post evaluations")


_REQUIRED = ("evaluation_id", "date", "release", "gpu_kind", "device_type", "preset", "tp", "steps", "seeds",
             "reruns", "configurations", "series")


@router.post("", status_code=201, responses={
    401: {"description": "no bearer token: an evaluator token is needed (LIVESTEP_EVALUATOR_TOKENS; never open)"},
    403: {"description": "the token is not an evaluator's (ingest, read and admin tokens cannot post evaluations)"}})
def post_evaluation(store: StoreDep, evaluator: Annotated[str, Depends(require_evaluator)],
                    body: Annotated[dict[str, Any], Body(description="livestep evaluate --out's JSON")]) -> dict[str, Any]:
    from collector.gpu_kinds import canonical_gpu_kind
    from collector.records import to_arrow
    from worker.evaluate import judge, records

    missing = [k for k in _REQUIRED if k not in body]
    if missing:
        raise HTTPException(422, detail=f"not an evaluation result: missing {missing}; post the JSON that "
                                        f"`livestep evaluate --out FILE` writes (fields: {', '.join(_REQUIRED)})")
    result = {k: v for k, v in body.items() if k not in ("verdicts", "overall", "drift", "band")}
    result["gpu_kind"] = canonical_gpu_kind(str(result["gpu_kind"]))
    _one_of("switch", None, EVALUATED)
    bad = [n for n in result["configurations"] if n not in EVALUATED]
    if bad:
        raise HTTPException(422, detail=f"unknown configuration(s) {bad}; valid: {', '.join(EVALUATED)}")
    try:
        judged = judge(result)
        rows = records(judged, evaluator=evaluator)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise HTTPException(422, detail=f"the evaluation's series cannot be judged: {type(e).__name__}: {e}") from e
    store.insert_arrow("evaluations", to_arrow("evaluation", rows), dedup_token=f"evaluation-{result['evaluation_id']}")
    get_switchboard(store).invalidate()  # the gate's evidence changed: polls see it now (api/switchboard.py)
    return {"evaluation_id": result["evaluation_id"], "rows": len(rows), "overall": judged["overall"],
            "evaluator": evaluator, "gpu_kind": result["gpu_kind"]}
