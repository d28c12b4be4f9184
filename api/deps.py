"""FastAPI dependencies as ``Annotated`` aliases: the app's store and settings, and bearer-token auth.

    @router.get("/v1/things", dependencies=[Depends(require_reader)])
    def things(store: StoreDep, settings: SettingsDep): ...
    @router.put("/v1/things/{name}")
    def put_thing(name: str, _admin: AdminDep): ...

The store and settings are the app's (``app.state``; ``api.app.create_app`` reads the settings once
per app); tests pass their own ``Settings`` to ``create_app`` or set ``app.state.settings``. One
rule for every role: no usable bearer token is 401 + ``WWW-Authenticate: Bearer``, a token that is
not one of the role's is 403 naming the role and its variables (the token is never echoed). A role
whose token list is empty is open, which settings allow only on a loopback bind:

    reader  LIVESTEP_READ_TOKENS   (ingest and admin tokens read too: workers poll switches)
    admin   LIVESTEP_ADMIN_TOKENS  (switch, canary and report writes)

Browsers read with a session cookie (``/login`` exchanges a reader's token for it) or behind a
trusted proxy's identity header (api/browser_auth.py); a page request with neither is redirected to
``/login``. The ingest role (LIVESTEP_INGEST_TOKENS) is checked by the collector's own route, with the same rule
(collector/auth.py, which both use).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from api.browser_auth import browser_reader, login_url, wants_html
from api.settings import Settings, is_loopback
from collector.auth import bearer_token, check_bearer
from collector.store import Store


def get_app_settings(request: Request) -> Settings:
    """The app's settings (``app.state.settings``, set once by ``create_app``)."""
    return request.app.state.settings


def get_store(request: Request) -> Store:
    store = getattr(request.app.state, "store", None)
    if store is None:
        err = getattr(request.app.state, "store_error", None) or "not opened"
        raise HTTPException(503, f"the store is not reachable ({err}); retry later", headers={"Retry-After": "5"})
    return store


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
Authorization = Annotated[str | None, Header(description="Bearer <token> (optional where the role is open)")]

# role -> (the variables whose tokens it accepts, the one that switches its check on)
ROLE_TOKENS = {
    "reader": (("read_tokens", "ingest_tokens", "admin_tokens"), "read_tokens"),
    "admin": (("admin_tokens",), "admin_tokens"),
}


def check_role(settings: Settings, role: str, authorization: str | None, request: Request | None = None) -> None:
    """Raise 401 (no bearer token) or 403 (not one of ``role``'s tokens) unless the request may act as ``role``.
    A reader without a bearer token may be a browser (api/browser_auth.py: the session cookie or a trusted
    proxy's identity header); a browser page request with neither is sent to /login (303) instead of a 401."""
    fields, switch = ROLE_TOKENS[role]
    if not getattr(settings, switch) and is_loopback(settings.host):
        return  # development: the role is open
    if role == "reader" and request is not None and bearer_token(authorization) is None:
        if browser_reader(settings, request):
            return
        if wants_html(request):
            raise HTTPException(303, "sign in first: /login", headers={"Location": login_url(request)})
    check_bearer(authorization, [t for f in fields for t in getattr(settings, f)], role,
                 [f"LIVESTEP_{f.upper()}" for f in fields])


def require_reader(request: Request, settings: SettingsDep, authorization: Authorization = None) -> None:
    """Reads, dashboards and workers' switch polls: a read, ingest or admin token (open when no read tokens),
    or, for a browser, the session cookie from /login or a trusted proxy's identity header."""
    check_role(settings, "reader", authorization, request)


def require_admin(settings: SettingsDep, authorization: Authorization = None) -> None:
    """Switch, canary and report writes: an admin token (open when no admin tokens)."""
    check_role(settings, "admin", authorization)


ReaderDep = Annotated[None, Depends(require_reader)]
AdminDep = Annotated[None, Depends(require_admin)]
