"""Readers in a browser: a signed session cookie (from a read token, on /login) or a trusted proxy's
identity header. Both grant the reader role only; writes always need an admin bearer token.

    cookie = issue_cookie(settings, token)         # after /login checked the token
    who = browser_reader(settings, request)         # "cookie" | "proxy:<user>" | None

The cookie (``livestep_session``) is HttpOnly, SameSite=Strict, Path=/, Secure over https, and signed
with ``LIVESTEP_SESSION_SECRET`` (itsdangerous; unset: a random key per process, so sessions end
with the process and do not cross api processes). It carries its expiry (``LIVESTEP_SESSION_TTL_S``)
and a fingerprint of the token it came from: a token removed from the configuration ends its
cookies at their next request.

The proxy header (``LIVESTEP_TRUSTED_PROXY_HEADER``, e.g. ``X-Auth-Request-User`` behind oauth2-proxy)
is off by default and honoured only from ``LIVESTEP_TRUSTED_PROXIES`` (addresses or networks; default
loopback): the proxy authenticates users, livestep trusts what it forwards.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from functools import lru_cache

from fastapi import Request
from itsdangerous import BadSignature, URLSafeSerializer

COOKIE = "livestep_session"
_SALT = "livestep.session.v1"
_PROCESS_KEY = secrets.token_urlsafe(32)  # the key while LIVESTEP_SESSION_SECRET is unset


def reader_tokens(settings) -> list[str]:
    """Tokens that may read (and so may sign in): read, ingest and admin tokens (api/deps.py's rule)."""
    return [*settings.read_tokens, *settings.ingest_tokens, *settings.admin_tokens]


def fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:32]


@lru_cache(maxsize=8)
def _serializer(secret: str) -> URLSafeSerializer:
    return URLSafeSerializer(secret, salt=_SALT)


def _secret(settings) -> str:
    return settings.session_secret or _PROCESS_KEY


def issue_cookie(settings, token: str, now: float | None = None) -> str:
    """The signed cookie value for a reader who proved ``token`` (the caller checked it)."""
    exp = int((time.time() if now is None else now) + settings.session_ttl_s)
    return _serializer(_secret(settings)).dumps({"exp": exp, "tok": fingerprint(token)})


def cookie_reader(settings, value: str | None) -> bool:
    """True when ``value`` is a cookie we signed, not expired, from a token still configured."""
    if not value:
        return False
    try:
        data = _serializer(_secret(settings)).loads(value)
    except BadSignature:
        return False
    if not isinstance(data, dict) or not isinstance(data.get("exp"), int) or data["exp"] < time.time():
        return False
    tok = str(data.get("tok", ""))
    return any(hmac.compare_digest(tok, fingerprint(t)) for t in reader_tokens(settings))


def _from_trusted_proxy(settings, host: str | None) -> bool:
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(addr in ipaddress.ip_network(n, strict=False) for n in settings.trusted_proxies)


def browser_reader(settings, request: Request) -> str | None:
    """Who reads without a bearer token: ``"cookie"``, ``"proxy:<user>"``, or None."""
    if cookie_reader(settings, request.cookies.get(COOKIE)):
        return "cookie"
    header = settings.trusted_proxy_header
    if header:
        user = (request.headers.get(header) or "").strip()
        if user and _from_trusted_proxy(settings, request.client.host if request.client else None):
            return f"proxy:{user[:200]}"
    return None


def wants_html(request: Request) -> bool:
    """A browser navigating (GET, HTML accepted): sent to /login rather than answered 401 JSON."""
    return request.method == "GET" and "text/html" in request.headers.get("accept", "")


def login_url(request: Request) -> str:
    """``/login?next=<this path and query>``: where a browser without a session is sent."""
    from urllib.parse import quote

    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return f"/login?next={quote(target, safe='')}"


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path on this site only (no scheme, no host, no //), else /dashboard/."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")) or any(c in target for c in "\r\n"):
        return "/dashboard/"
    return target
