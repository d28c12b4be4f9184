"""Settings of the switch control plane, the alert webhook, canaries and reports (env prefix LIVESTEP_).

    LIVESTEP_ADMIN_TOKEN       bearer token for switch and canary writes
    LIVESTEP_WEBHOOK_SECRET    HMAC-SHA256 secret of POST /v1/alerts (and of api/notify.py's posts)
    LIVESTEP_WEBHOOK_URLS      comma-separated URLs notify posts critical findings to (default: our own)
    LIVESTEP_HOST              the address the server binds; outside loopback both secrets must be set

On loopback, development defaults are used for unset secrets; ``get_switch_settings()`` is cached
and tests override it through ``app.dependency_overrides`` or ``reset_switch_settings()``.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_ADMIN_TOKEN = "livestep-dev-admin"
DEV_WEBHOOK_SECRET = "livestep-dev-webhook-secret"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SwitchSettingsError(ValueError):
    """A setting is unsafe or invalid; the message says which and what is valid."""


class SwitchSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LIVESTEP_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None
    webhook_secret: str | None = None
    ingest_tokens: str = Field(default="", description="comma-separated tokens also allowed to poll switches")
    webhook_urls: str = Field(default="", description="comma-separated; empty = this server's /v1/alerts")
    webhook_window_s: int = Field(default=300, ge=1, le=86400, description="replay window of signatures")
    switch_cache_s: float = Field(default=0.5, ge=0, le=60, description="how long resolved rules are cached")
    switch_poll_s: float = Field(default=1.0, gt=0, le=3600, description="poll interval hinted to workers")
    reports_dir: Path = Path("reports")
    canary_min_sessions: int = Field(default=20, ge=1)

    @model_validator(mode="after")
    def _secrets_outside_loopback(self) -> SwitchSettings:
        if not is_loopback(self.host):
            missing = [n for n in ("admin_token", "webhook_secret") if not getattr(self, n)]
            if missing:
                raise SwitchSettingsError(
                    f"binding {self.host} (not loopback) needs LIVESTEP_{', LIVESTEP_'.join(m.upper() for m in missing)} "
                    "set; development defaults are allowed on 127.0.0.1/::1/localhost only"
                )
        for n in ("admin_token", "webhook_secret"):
            if getattr(self, n) is None:
                setattr(self, n, DEV_ADMIN_TOKEN if n == "admin_token" else DEV_WEBHOOK_SECRET)
        return self

    @property
    def webhook_url_list(self) -> list[str]:
        urls = [u.strip() for u in self.webhook_urls.split(",") if u.strip()]
        return urls or [f"http://127.0.0.1:{self.port}/v1/alerts" if is_loopback(self.host) else
                        f"http://{self.host}:{self.port}/v1/alerts"]


@lru_cache(maxsize=1)
def get_switch_settings() -> SwitchSettings:
    return SwitchSettings()


def reset_switch_settings() -> None:
    get_switch_settings.cache_clear()
