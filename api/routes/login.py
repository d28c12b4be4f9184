"""Browser sign-in: ``/login`` exchanges a reader's token for the session cookie (api/browser_auth.py).

    GET  /login?next=/dashboard/   the form (a browser without a session is sent here by the read routes)
    POST /login                    token=...&next=...: 303 to next with the cookie, or 401 with the form again
    GET  /logout                   drops the cookie, back to /login

The form posts ``application/x-www-form-urlencoded`` (parsed here: no multipart dependency). ``next``
is followed only to a path of this site.
"""

from __future__ import annotations

import hmac
import html
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from api.browser_auth import COOKIE, issue_cookie, reader_tokens, safe_next
from api.deps import SettingsDep

router = APIRouter(tags=["browser sign-in"])
MAX_FORM_BYTES = 16 * 1024

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>livestep: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<style>body{{font-family:system-ui,sans-serif;max-width:28rem;margin:4rem auto;padding:0 1rem;color:#222}}
input{{width:100%;padding:.5rem;margin:.4rem 0;box-sizing:border-box}}button{{padding:.5rem 1.2rem}}
.error{{color:#a00}}</style></head>
<body><h1>livestep</h1>
<p>Sign in with a read token (<code>LIVESTEP_READ_TOKENS</code>) to open the dashboards and reports.</p>
{error}
<form method="post" action="/login">
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<input type="hidden" name="next" value="{next}">
<button type="submit">Sign in</button>
</form></body></html>"""


def _page(next_url: str, error: str = "", status: int = 200) -> HTMLResponse:
    err = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return HTMLResponse(_PAGE.format(error=err, next=html.escape(next_url, quote=True)), status_code=status,
                        headers={"Cache-Control": "no-store"})


@router.get("/login", response_class=HTMLResponse, summary="The sign-in form for browsers")
def login_form(next: str | None = Query(None, max_length=2048, description="where to go after signing in")):
    return _page(safe_next(next))


@router.post("/login", response_class=HTMLResponse, status_code=303,
             summary="Exchange a read token for an HttpOnly, SameSite=Strict session cookie",
             responses={303: {"description": "signed in: the cookie is set, on to next"},
                        400: {"description": "not this form"},
                        401: {"description": "not a token that may read: the form again"},
                        413: {"description": "form too large"}})
async def login(request: Request, settings: SettingsDep):
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return _page("/dashboard/", f"the form is larger than {MAX_FORM_BYTES} bytes", 413)
    try:
        form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    except ValueError:  # more fields than the form has
        return _page("/dashboard/", "the form has more fields than token and next", 400)
    token = (form.get("token") or [""])[0].strip()
    next_url = safe_next((form.get("next") or [None])[0])
    if not token:
        return _page(next_url, "enter a token", 401)
    if not any(hmac.compare_digest(token.encode(), t.encode()) for t in reader_tokens(settings)):
        return _page(next_url, "that token may not read here: use one of LIVESTEP_READ_TOKENS", 401)
    resp = RedirectResponse(next_url, status_code=303)
    resp.set_cookie(COOKIE, issue_cookie(settings, token), max_age=settings.session_ttl_s, path="/",
                    httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return resp


@router.get("/logout", summary="Drop the browser session cookie")
def logout() -> RedirectResponse:
    resp = RedirectResponse("/login", status_code=303)
    resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return resp
