"""Bearer-token checks, one rule for the whole service (the ingest route here, every API role in api/deps.py).

    check_bearer(request_authorization_header, allowed_tokens, role="ingest", names=["LIVESTEP_INGEST_TOKENS"])

No usable ``Authorization: Bearer <token>`` header is 401 + ``WWW-Authenticate: Bearer``; a token that
is not one of ``allowed`` is 403 naming the role and the variables that hold its tokens (never the
token itself). Tokens are compared in constant time. Whether a role is open (no tokens configured,
loopback only) is the caller's decision, made before calling.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None when missing, empty or another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def check_bearer(authorization: str | None, allowed: list[str], role: str, names: list[str]) -> None:
    """Raise 401 (no bearer token) or 403 (a token not in ``allowed``); return when the token is allowed."""
    article = "an" if role[:1] in "aeiou" else "a"
    token = bearer_token(authorization)
    if token is None:
        raise HTTPException(401, f"missing bearer token: send 'Authorization: Bearer <{role} token>' "
                                 f"(one of {' / '.join(names)})", headers={"WWW-Authenticate": "Bearer"})
    if not any(hmac.compare_digest(token.encode(), t.encode()) for t in allowed):
        raise HTTPException(403, f"the bearer token is not allowed here: this needs {article} {role} token "
                                 f"(one of {' / '.join(names)})")
