"""Switch control plane (contract 3): workers poll ``GET /v1/switches``; admins change switches.

    GET  /v1/switches?worker_id=w3&release=v7&gpu_kind=h200   -> {"switches": {...}, "version": n} + ETag
         ``switches`` holds only the names some rule in the worker's scope decides (scope rules and
         canary cohorts); a name left out is the worker's own business: it keeps the value it started
         with (``{}`` when no rule applies). ``version`` changes with every rule change.
    PUT  /v1/switches/{name}   {"value": false, "scope": "release=v7", "who": "...", "why": "..."}  (admin)
    POST /v1/switches/{name}/clear  {"scope": "release=v7", "who": "...", "why": "..."}  (admin): the scope
         inherits again
    POST /v1/switches/{name}/reenable  {"scope": "release=v7", "who": "...", "why": "..."}  (admin): undo the
         flips that turned it off in the scope: back on for the workers they turned off (those that ran
         it), lifted for the rest (api/reenable.py); a PUT with ``value: true`` reaches every worker of the scope
    GET  /v1/switches/rules    the active rules, and ``defaults``: the production configuration a
         release's workers start with (information for dashboards; never applied by the control plane)
    GET  /v1/switches/history  the audit trail
    GET  /v1/switches/explain?worker_id=&release=&gpu_kind=   for each switch: the value, the rule that
         decided it and why, and the covering rules that did not (api/switchboard.py: the precedence model)

Turning a numeric switch on (``NUMERIC_SWITCHES``) needs a release in the scope (422) and a passing
evaluation for it (409; api/evaluation_gate.py), as a canary does; turning one off never does.
An ``If-None-Match`` equal to the current ETag answers 304 (an unchanged poll costs nothing).
Turning a switch off that is already off in that scope is answered 200 with ``changed: false``
and recorded as a no-op.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api import evaluation_gate
from api.deps import AdminDep, ReaderDep, SettingsDep, StoreDep
from api.reenable import ReenableError, reenable
from api.routes._common import Label, OptionalRangeDep, PageDep
from api.switchboard import DEFAULTS, Switchboard, SwitchError, check_name, get_switchboard, parse_scope
from collector.records import SWITCH_NAMES

router = APIRouter(prefix="/v1/switches", tags=["switches"])
PRECEDENCE = ("the most recent active rule covering the worker decides (scope keys all equal its labels, and "
              "for a cohort rule its bucket in the cohort); a manual write supersedes the narrower automatic "
              "rules it covers; a switch no rule covers keeps the worker's own value")


class SwitchesOut(BaseModel):
    switches: dict[str, bool] = Field(description="only the switches a rule in scope decides; absent = the "
                                                  "worker keeps its own value")
    version: int
    poll_interval_s: float


class SwitchClear(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: str = Field(default="", max_length=400, description="the scope whose own rule is removed")
    who: str = Field(min_length=1, max_length=200)
    why: str = Field(min_length=1, max_length=2000)


class SwitchReenable(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: str = Field(default="", max_length=400, description="the scope whose flips are undone; '' = whole fleet")
    who: str = Field(min_length=1, max_length=200)
    why: str = Field(min_length=1, max_length=2000)


class SwitchWrite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: bool = Field(description="true = on, false = off")
    scope: str = Field(default="", max_length=400, description="'release=v7,gpu_kind=h200'; '' = whole fleet")
    who: str = Field(min_length=1, max_length=200, description="who made the change")
    why: str = Field(min_length=1, max_length=2000, description="why (incident, ticket, finding)")


def _etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:24] + '"'


def _board(store: StoreDep, settings: SettingsDep) -> Switchboard:
    """The store's switchboard, its snapshot cached for the server's ``switch_cache_s``."""
    return get_switchboard(store, settings.switch_cache_s)


BoardDep = Annotated[Switchboard, Depends(_board)]


@contextlib.contextmanager
def _invalid_as_422():
    """A write the switchboard refuses (a malformed scope or cohort) answers 422 naming what is valid."""
    try:
        yield
    except SwitchError as e:
        raise HTTPException(422, detail=str(e)) from e


def _known(name: str) -> None:
    """404 naming the valid switches unless ``name`` is one."""
    try:
        check_name(name)
    except SwitchError as e:
        raise HTTPException(404, detail=str(e)) from e


def _matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


@router.get("", response_model=SwitchesOut, responses={304: {"description": "unchanged since that ETag"}})
def get_switches(
    board: BoardDep,
    settings: SettingsDep,
    _auth: ReaderDep,
    worker_id: Label = None,
    release: Label = None,
    gpu_kind: Label = None,
    if_none_match: Annotated[str | None, Header(max_length=1000)] = None,
) -> Response:
    switches, version = board.resolve(worker_id, release, gpu_kind, settings.flip_waves, settings.flip_wave_s)
    body = orjson.dumps({"switches": switches, "version": version, "poll_interval_s": settings.switch_poll_s})
    etag = _etag(body)
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if _matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


@router.get("/rules")
def list_rules(store: StoreDep, _auth: ReaderDep) -> dict[str, Any]:
    board = get_switchboard(store)
    rules, version = board.snapshot()
    return {
        "version": version,
        "names": list(SWITCH_NAMES),
        "defaults": dict(DEFAULTS),
        "defaults_by_gpu_kind": evaluation_gate.defaults_by_kind(store, DEFAULTS),  # numeric: with evaluations
        "rules": [r.as_dict() for r in board.rules()],
        "count": len(rules),
    }


@router.get("/explain")
def explain(board: BoardDep, _auth: ReaderDep, worker_id: Label = None,
            release: Label = None, gpu_kind: Label = None) -> dict[str, Any]:
    """For each switch, the value a worker with these labels gets, the rule that decided it and why
    (the most recent rule covering the worker), and the rules that cover it but do not decide."""
    _, version = board.snapshot()
    return {"labels": {k: v for k, v in (("worker_id", worker_id), ("release", release), ("gpu_kind", gpu_kind))
                       if v},
            "version": version, "precedence": PRECEDENCE,
            "switches": board.explain(worker_id, release, gpu_kind)}


@router.get("/history")
def history(
    store: StoreDep,
    page: PageDep,
    _auth: ReaderDep,
    tr: OptionalRangeDep,
    name: Annotated[str | None, Query(max_length=64)] = None,
    source: Annotated[str | None, Query(pattern="^(api|alert|incident|canary)$")] = None,
    changed: bool | None = None,
) -> dict[str, Any]:
    if name is not None:
        _known(name)
    rows = get_switchboard(store).history(name=name, source=source, changed=changed, start=tr.start, end=tr.end,
                                          limit=page.limit, offset=page.offset)
    return {"decisions": rows, "limit": page.limit, "offset": page.offset}


@router.put("/{name}")
def put_switch(name: str, body: SwitchWrite, store: StoreDep, board: BoardDep, _admin: AdminDep) -> dict[str, Any]:
    _known(name)
    try:
        with _invalid_as_422():
            evidence = {}
            if body.value:  # on: a numeric switch only with a passing evaluation there; off is always allowed
                evaluated = evaluation_gate.require_for_scope(store, name, parse_scope(body.scope))
                evidence = {"evaluations": evaluated} if evaluated else {}
            d = board.set(name, body.value, body.scope, actor=body.who, reason=body.why, source="api",
                          evidence=evidence)
    except evaluation_gate.GateError as e:
        evaluation_gate.refused(board, name, body.scope, body.value, body.who, body.why, str(e))
        raise HTTPException(e.status, detail=str(e)) from e
    return d.to_dict()


@router.post("/{name}/clear")
def clear_switch(name: str, body: SwitchClear, board: BoardDep, _admin: AdminDep) -> dict[str, Any]:
    """Remove a scope's own rule (the switch inherits again); a no-op (recorded) when there is none."""
    _known(name)
    with _invalid_as_422():
        return board.clear(name, body.scope, actor=body.who, reason=body.why).to_dict()


@router.post("/{name}/reenable")
def reenable_switch(name: str, body: SwitchReenable, store: StoreDep, board: BoardDep,
                    _admin: AdminDep) -> dict[str, Any]:
    """Undo the flips of ``name`` in a scope: on again for the workers they turned off (the workers that ran
    it), lifted for the others, who keep the value they have (api/reenable.py); 409 when nothing turned it
    off there. A numeric switch needs the gate's evidence for the scope, as a PUT turning it on."""
    _known(name)
    try:
        with _invalid_as_422():
            evaluation_gate.require_for_scope(store, name, parse_scope(body.scope))
            return reenable(store, name, body.scope, actor=body.who, reason=body.why)
    except ReenableError as e:
        raise HTTPException(409, detail=str(e)) from e
    except evaluation_gate.GateError as e:
        evaluation_gate.refused(board, name, body.scope, True, body.who, body.why, str(e))
        raise HTTPException(e.status, detail=str(e)) from e
