"""The server's one ``Settings`` (env ``LIVESTEP_*``): bind, role, tokens, alert webhook, switches, canaries, reports.

    app = create_app()                                     # reads the environment once, into app.state.settings
    app = create_app(Settings(clickhouse_dsn=..., spool_dir=...))   # explicit, in tests
    settings = load_settings(host=..., port=...)           # env + overrides, one SettingsError (livestep serve)

Extends ``collector.settings.CollectorSettings`` (store DSN, ingest tokens, spool, writer), so one
flat ``LIVESTEP_*`` namespace configures the whole server; routes read the app's copy through
api/deps.py. On loopback everything may stay unset (development; an unset webhook secret becomes
the public development secret); on any other bind the server refuses to start until the tokens and
secret its role needs are set (the scheduler's findings notifier needs the webhook secret and admin
tokens; the development secret never counts). Token lists are comma-separated in the environment.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from collector.settings import REPO_DIR, CollectorSettings, TokenList, split_tokens

ROLES = ("all", "collector", "api", "scheduler")
Role = Literal["all", "collector", "api", "scheduler"]
DEV_WEBHOOK_SECRET = "livestep-dev-webhook-secret"  # public: the loopback fallback, refused anywhere else


class SettingsError(Exception):
    """Settings are unsafe or invalid; the message says which and what is valid."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(CollectorSettings):
    """The server: which roles this process plays, where it listens, who may call it."""

    host: str = Field(default="127.0.0.1", min_length=1, max_length=255,
                      description="bind address; anything but loopback requires the tokens/secret below")
    port: int = Field(default=8000, ge=0, le=65535, description="bind port (0 = any free port)")
    role: Role = Field(
        default="all",
        description="all = collector + api + scheduler in one process (required on chDB); collector = "
        "POST /v1/telemetry + spool writer; api = read routes; scheduler = analytics jobs",
    )
    read_tokens: TokenList = Field(default_factory=list, max_length=1024,
                                   description="bearer tokens for GET routes (comma-separated); "
                                   "empty = open reads, allowed only on loopback")
    admin_tokens: TokenList = Field(default_factory=list, max_length=1024,
                                    description="bearer tokens for writes (switches, canaries); "
                                    "required outside loopback (roles api, scheduler)")
    webhook_secret: str | None = Field(default=None, min_length=16, max_length=4096,
                                       description="HMAC-SHA256 secret of the alert webhook and of the "
                                       "scheduler's findings posts; required outside loopback (roles api, "
                                       "scheduler); on loopback an unset secret is the development one")
    webhook_urls: str = Field(default="", max_length=8192,
                              description="comma-separated URLs the findings notifier posts critical findings to; "
                              "empty = this server's own /v1/alerts")
    webhook_window_s: int = Field(default=300, ge=1, le=86400,
                                  description="replay window of signed webhook deliveries (seconds)")
    switch_cache_s: float = Field(default=0.5, ge=0, le=60, description="how long resolved switch rules are cached")
    switch_poll_s: float = Field(default=1.0, gt=0, le=3600, description="poll interval hinted to workers")
    canary_min_sessions: int = Field(default=30, ge=1, le=1_000_000, description="sessions per side before a canary is judged")
    reports_dir: Path = Field(default=REPO_DIR / "var" / "reports",
                              description="where weekly reports (HTML + JSON) are written")

    @field_validator("read_tokens", "admin_tokens", mode="before")
    @classmethod
    def _split_api_tokens(cls, v):
        return split_tokens(v)

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(ROLES[1:]) if self.role == "all" else frozenset({self.role})

    @property
    def webhook_url_list(self) -> list[str]:
        """Where the findings notifier posts: ``webhook_urls``, else this server's own ``/v1/alerts``."""
        urls = [u.strip() for u in self.webhook_urls.split(",") if u.strip()]
        host = "127.0.0.1" if is_loopback(self.host) or self.host in ("0.0.0.0", "::") else self.host
        return urls or [f"http://{host}:{self.port}/v1/alerts"]

    @model_validator(mode="after")
    def _refuse_open_server(self) -> Settings:
        if is_loopback(self.host):
            if not self.webhook_secret:
                self.webhook_secret = DEV_WEBHOOK_SECRET
            return self
        missing = []
        secret_ok = bool(self.webhook_secret) and self.webhook_secret != DEV_WEBHOOK_SECRET  # that one is public
        if "collector" in self.roles and not self.ingest_tokens:
            missing.append("LIVESTEP_INGEST_TOKENS")
        if "api" in self.roles:
            if not self.read_tokens:
                missing.append("LIVESTEP_READ_TOKENS")
            if not self.admin_tokens:
                missing.append("LIVESTEP_ADMIN_TOKENS")
            if not secret_ok:
                missing.append("LIVESTEP_WEBHOOK_SECRET")
        if "scheduler" in self.roles and not secret_ok:  # the findings notifier signs its posts (rollback)
            missing.append("LIVESTEP_WEBHOOK_SECRET")
        missing = list(dict.fromkeys(missing))
        if missing:
            raise ValueError(
                f"refusing to bind {self.host} (not loopback) without {', '.join(missing)}; set them, or bind "
                f"127.0.0.1 / ::1 / localhost for development"
            )
        return self


def load_settings(**overrides) -> Settings:
    """Settings from the environment plus ``overrides``; a ``SettingsError`` with one clear message."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors())
        raise SettingsError(msgs.replace("Value error, ", "")) from e


@lru_cache
def get_settings() -> Settings:
    """The environment's settings for code outside an app (analytics jobs' reports directory); cached.
    An app reads its own once (``create_app``) and routes use that one (api/deps.py)."""
    return load_settings()
