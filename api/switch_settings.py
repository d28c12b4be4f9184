"""Settings of the switch control plane, the alert webhook, canaries and reports (env prefix LIVESTEP_).

    LIVESTEP_ADMIN_TOKENS      bearer tokens for switch and canary writes (open on loopback when empty)
    LIVESTEP_READ_TOKENS       bearer tokens for reads and switch polls (ingest tokens may poll too)
    LIVESTEP_WEBHOOK_SECRET    HMAC-SHA256 secret of POST /v1/alerts and of api/notify.py's posts
    LIVESTEP_WEBHOOK_URLS      comma-separated URLs notify posts critical findings to (default: our own)
    LIVESTEP_WEBHOOK_WINDOW_S  replay window of signed deliveries (seconds)

The names are the server's (api/settings.py): when the app carries its ``Settings`` in
``app.state.settings``, ``get_switch_settings`` takes the bind address, tokens, secret and reports
directory from there. Outside loopback the tokens and the secret must be set; on loopback an unset
webhook secret falls back to a development secret. Tests override ``get_switch_settings``.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from fastapi import Request
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from collector.settings import REPO_DIR, split_tokens

DEV_WEBHOOK_SECRET = "livestep-dev-webhook-secret"
Tokens = Annotated[list[str], NoDecode]


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class SwitchSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LIVESTEP_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    admin_tokens: Tokens = Field(default_factory=list)
    read_tokens: Tokens = Field(default_factory=list)
    ingest_tokens: Tokens = Field(default_factory=list)
    webhook_secret: str | None = None
    webhook_urls: str = Field(default="", description="comma-separated; empty = this server's /v1/alerts")
    webhook_window_s: int = Field(default=300, ge=1, le=86400, description="replay window of signatures")
    switch_cache_s: float = Field(default=0.5, ge=0, le=60, description="how long resolved rules are cached")
    switch_poll_s: float = Field(default=1.0, gt=0, le=3600, description="poll interval hinted to workers")
    reports_dir: Path = REPO_DIR / "var" / "reports"
    canary_min_sessions: int = Field(default=30, ge=1, description="sessions per side before a canary is judged")

    @field_validator("admin_tokens", "read_tokens", "ingest_tokens", mode="before")
    @classmethod
    def _split(cls, v):
        return split_tokens(v)

    @model_validator(mode="after")
    def _secrets_outside_loopback(self) -> SwitchSettings:
        if not is_loopback(self.host):
            missing = [f"LIVESTEP_{n.upper()}" for n in ("admin_tokens", "webhook_secret") if not getattr(self, n)]
            if self.webhook_secret == DEV_WEBHOOK_SECRET:  # public: never off loopback
                missing.append("LIVESTEP_WEBHOOK_SECRET (not the public development secret)")
            if missing:
                raise ValueError(f"binding {self.host} (not loopback) needs {', '.join(missing)} set; "
                                 "development defaults are allowed on 127.0.0.1/::1/localhost only")
        elif not self.webhook_secret:
            self.webhook_secret = DEV_WEBHOOK_SECRET
        return self

    @property
    def webhook_url_list(self) -> list[str]:
        urls = [u.strip() for u in self.webhook_urls.split(",") if u.strip()]
        host = "127.0.0.1" if is_loopback(self.host) or self.host in ("0.0.0.0", "::") else self.host
        return urls or [f"http://{host}:{self.port}/v1/alerts"]


@lru_cache(maxsize=1)
def env_switch_settings() -> SwitchSettings:
    return SwitchSettings()


def from_app_settings(app_settings) -> SwitchSettings:
    """The switch settings of a server whose ``api.settings.Settings`` is ``app_settings``."""
    base = env_switch_settings()
    keep = {k: getattr(app_settings, k) for k in ("host", "port", "admin_tokens", "read_tokens", "ingest_tokens",
                                                   "webhook_secret", "reports_dir") if hasattr(app_settings, k)}
    merged = {**base.model_dump(), **{k: v for k, v in keep.items() if v is not None}}
    if merged.get("webhook_secret") == DEV_WEBHOOK_SECRET:  # the env's loopback fallback, not a configured
        merged["webhook_secret"] = None                      # secret: re-decided for the server's own bind
    return SwitchSettings(**merged)


def get_switch_settings(request: Request) -> SwitchSettings:
    app_settings = getattr(request.app.state, "settings", None)
    if app_settings is None:
        return env_switch_settings()
    cached = getattr(request.app.state, "switch_settings", None)
    if cached is None:
        cached = request.app.state.switch_settings = from_app_settings(app_settings)
    return cached
