"""Server settings: bind address, role, read/admin tokens, webhook secret, reports (env ``LIVESTEP_*``).

    settings = get_settings()                               # cached, from the environment
    app = create_app(Settings(clickhouse_dsn=..., spool_dir=...))   # explicit, in tests

Extends ``collector.settings.CollectorSettings`` (store DSN, ingest tokens, spool, writer), so one
flat ``LIVESTEP_*`` namespace configures the whole server. On loopback everything may stay unset
(development); on any other bind the server refuses to start until the tokens and secret its role
needs are set (the scheduler's findings notifier needs the webhook secret and admin tokens; the
public development secret never counts). Token lists are comma-separated in the environment.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from api.switch_settings import DEV_WEBHOOK_SECRET
from collector.settings import REPO_DIR, CollectorSettings, TokenList, split_tokens

ROLES = ("all", "collector", "api", "scheduler")
Role = Literal["all", "collector", "api", "scheduler"]


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
                                       "scheduler)")
    reports_dir: Path = Field(default=REPO_DIR / "var" / "reports",
                              description="where weekly reports (HTML + JSON) are written")

    @field_validator("read_tokens", "admin_tokens", mode="before")
    @classmethod
    def _split_api_tokens(cls, v):
        return split_tokens(v)

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(ROLES[1:]) if self.role == "all" else frozenset({self.role})

    @model_validator(mode="after")
    def _refuse_open_server(self) -> Settings:
        if is_loopback(self.host):
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
        if "scheduler" in self.roles:  # the findings notifier (automatic rollback): it signs its posts, and
            if not self.admin_tokens:  # its switch settings refuse a non-loopback bind without admin tokens
                missing.append("LIVESTEP_ADMIN_TOKENS")
            if not secret_ok:
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
    """The process's settings (cached; tests pass their own to ``create_app`` instead)."""
    return load_settings()
