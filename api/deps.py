"""FastAPI dependencies as ``Annotated`` aliases: the store, the settings, read/admin auth.

    @router.get("/v1/things", dependencies=[ReadAuth])
    def things(store: StoreDep, settings: SettingsDep): ...

The store and settings are the app's (``app.state``), set by ``api.app.create_app``'s lifespan;
tests build an app with their own ``Settings``. Auth is open when the token list is empty, which
settings allow only on a loopback bind.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from api.settings import Settings
from collector.store import Store


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_store(request: Request) -> Store:
    store = getattr(request.app.state, "store", None)
    if store is None:
        err = getattr(request.app.state, "store_error", None) or "not opened"
        raise HTTPException(503, f"the store is not reachable ({err}); retry later", headers={"Retry-After": "5"})
    return store


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
StoreDep = Annotated[Store, Depends(get_store)]


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _check(request: Request, tokens: list[str], what: str) -> None:
    if not tokens:
        return
    token = bearer_token(request)
    if token is None:
        raise HTTPException(401, f"missing bearer token: send 'Authorization: Bearer <{what} token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not any(hmac.compare_digest(token.encode(), t.encode()) for t in tokens):
        raise HTTPException(401, f"wrong bearer token: use one of the {what} tokens", headers={"WWW-Authenticate": "Bearer"})


def require_read(request: Request, settings: SettingsDep) -> None:
    """Read routes: a read or admin token when read tokens are configured."""
    if settings.read_tokens:
        _check(request, settings.read_tokens + settings.admin_tokens, "read")


def require_admin(request: Request, settings: SettingsDep) -> None:
    """Write routes: an admin token when admin tokens are configured."""
    _check(request, settings.admin_tokens, "admin")


ReadAuth = Depends(require_read)
AdminAuth = Depends(require_admin)
