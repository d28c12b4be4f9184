"""The server's one ``Settings`` (env ``LIVESTEP_*``): bind, role, tokens, alert webhook, switches, canaries, reports.

    app = create_app()                                     # reads the environment once, into app.state.settings
    app = create_app(Settings(clickhouse_dsn=..., spool_dir=...))   # explicit, in tests
    settings = load_settings(host=..., port=...)           # env + overrides, one SettingsError (livestep serve)

Extends ``collector.settings.CollectorSettings`` (store DSN, ingest tokens, spool, writer), so one
flat ``LIVESTEP_*`` namespace configures the whole server; routes read the app's copy through
api/deps.py. On loopback everything may stay unset (development; an unset webhook secret becomes
the public development secret); on any other bind the server refuses to start until the tokens and
secret its role needs are set (the scheduler signs its incident notifications with the webhook
secret; the development secret never counts). Token lists are comma-separated in the environment.
"""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import NoDecode

from collector.settings import CollectorSettings, TokenList, data_home, split_tokens

ROLES = ("all", "collector", "api", "scheduler")
Role = Literal["all", "collector", "api", "scheduler"]
DEV_WEBHOOK_SECRET = "livestep-dev-webhook-secret"  # public: the loopback fallback, refused anywhere else
SENDER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MIN_SECRET_CHARS = 16


def split_senders(v) -> dict[str, str]:
    """'am=tok1,grafana=tok2' (or a JSON object, or a dict) -> {sender name: bearer token}.

    A name is 1-64 of ``A-Z a-z 0-9 _ . -``; a token has at least 16 characters (like the webhook
    secret); names and tokens are unique. Raises ValueError naming the bad entry (never its token)."""
    if isinstance(v, str):
        v = v.strip()
        if v.startswith("{"):
            import json

            v = json.loads(v)
        else:
            pairs = {}
            for i, item in enumerate(p.strip() for p in v.split(",") if p.strip()):
                name, eq, token = item.partition("=")
                if not eq:
                    raise ValueError(f"sender #{i + 1} is not 'name=token' (valid: 'alertmanager=<token>,grafana=<token>')")
                if name.strip() in pairs:
                    raise ValueError(f"sender name {name.strip()!r} is given twice")
                pairs[name.strip()] = token.strip()
            v = pairs
    if not isinstance(v, dict):
        raise ValueError("webhook bearer tokens are 'name=token' pairs, comma-separated")  # noqa: TRY004 (pydantic reports ValueError)
    for name, token in v.items():
        if not isinstance(name, str) or not SENDER_NAME.fullmatch(name):
            raise ValueError(f"sender name {str(name)[:70]!r} is not 1-64 of A-Z a-z 0-9 _ . -")
        if not isinstance(token, str) or len(token) < MIN_SECRET_CHARS:
            raise ValueError(f"sender {name!r}: its token has fewer than {MIN_SECRET_CHARS} characters")
    if len(set(v.values())) != len(v):
        raise ValueError("two senders share one bearer token: give each sender its own")
    return dict(v)


class SettingsError(Exception):
    """Settings are unsafe or invalid; the message says which and what is valid."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# "name=token" pairs read from the env as one comma-separated string (``Settings._split_senders``)
NamedTokens = Annotated[dict[str, str], NoDecode]


def _named_tokens(who: str, then: str):
    """A field of "name=token" pairs: ``who`` the names are, and what follows for them (``then``)."""
    return Field(default_factory=dict, max_length=256,
                 description=f"{who}: 'name=token' pairs, comma-separated, tokens of >= 16 characters; {then}")


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
    webhook_bearer_tokens: NamedTokens = _named_tokens(
        "senders that authenticate POST /v1/alerts with 'Authorization: Bearer <token>' instead of "
        "an HMAC signature (Alertmanager's http_config.authorization, Grafana's authorization header)",
        "the name goes into the audit. Never open: with none set, a bearer delivery is 401 on every bind")
    evaluator_tokens: NamedTokens = _named_tokens(
        "evaluators that may POST /v1/evaluations (the evidence the numeric-switch gate reads)",
        "the name is stored with every record. Never open and never the ingest token: with none set, posting "
        "an evaluation is refused on every bind")
    webhook_urls: str = Field(default="", max_length=8192,
                              description="comma-separated external receivers of incident notifications "
                              "(signed with the webhook secret; api/incidents.py); empty = none (recorded only)")
    alertmanager_url: str | None = Field(
        default=None, min_length=8, max_length=2048, pattern=r"^https?://",
        description="an Alertmanager (http(s)://host:9093): findings are published to it as alerts (its "
        "grouping, silences, inhibition; critical ones with a switch come back to POST /v1/alerts, which "
        "flips it) instead of api/incidents.py grouping them; unset (default): the embedded incidents")
    incident_repeat_s: float = Field(default=86400.0, ge=60, le=30 * 86400,
                                     description="an incident still not resolved is notified again this long "
                                     "after its last notification: one daily digest by default (Alertmanager's "
                                     "repeat_interval)")
    incident_resolve_after_s: float = Field(default=48 * 3600.0, ge=0, le=30 * 86400,
                                            description="an incident whose evidence is gone resolves only after this "
                                            "long without it (a daily detector may miss a slow cause one day)")
    webhook_window_s: int = Field(default=300, ge=1, le=86400,
                                  description="replay window of signed webhook deliveries (seconds)")
    switch_cache_s: float = Field(default=0.5, ge=0, le=60, description="how long resolved switch rules are cached")
    switch_poll_s: float = Field(default=1.0, gt=0, le=3600, description="poll interval hinted to workers")
    # a switch change reaches a scope's workers in waves (Argo Rollouts' maxUnavailable): wave k of ``flip_waves``
    # (a stable hash of the worker id) gets it ``k * flip_wave_s`` after the rule was written, so at most
    # 1/flip_waves of the workers apply it at once (api/switchboard.py ``Switchboard.resolve``)
    flip_waves: int = Field(default=1, ge=1, le=100, description="waves a switch change rolls out in (1: all at once)")
    flip_wave_s: float = Field(default=60.0, ge=0, le=3600, description="seconds between waves of a switch change")
    canary_min_sessions: int = Field(default=30, ge=1, le=1_000_000, description="sessions per side before a canary is judged")
    session_secret: str | None = Field(default=None, min_length=16, max_length=4096,
                                       description="key that signs browser session cookies (/login); unset: a random "
                                       "key per process (sessions end with it; set one for several api processes)")
    session_ttl_s: int = Field(default=12 * 3600, ge=60, le=30 * 86400,
                               description="how long a browser session cookie from /login stays valid (seconds)")
    trusted_proxy_header: str | None = Field(default=None, min_length=1, max_length=128,
                                             pattern=r"^[A-Za-z0-9-]+$",
                                             description="request header naming the user a trusted reverse proxy "
                                             "authenticated (e.g. X-Auth-Request-User, oauth2-proxy); it grants "
                                             "reading; unset (default): ignored")
    trusted_proxies: TokenList = Field(default_factory=lambda: ["127.0.0.1/32", "::1/128"], max_length=256,
                                       description="addresses or networks (comma-separated) whose "
                                       "trusted_proxy_header is believed; default loopback")
    reports_dir: Path = Field(default_factory=lambda: data_home() / "reports",
                              description="where weekly reports (HTML + JSON) are written (default "
                              "<LIVESTEP_HOME or ./var>/reports)")

    @field_validator("read_tokens", "admin_tokens", "trusted_proxies", mode="before")
    @classmethod
    def _split_api_tokens(cls, v):
        return split_tokens(v)

    @field_validator("webhook_bearer_tokens", "evaluator_tokens", mode="before")
    @classmethod
    def _split_senders(cls, v):
        return split_senders(v)

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v):
        for n in v:
            try:
                ipaddress.ip_network(n, strict=False)
            except ValueError:
                raise ValueError(f"trusted proxy {n!r} is not an address or network (e.g. 10.0.0.5, 10.0.0.0/24)") from None
        return v

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(ROLES[1:]) if self.role == "all" else frozenset({self.role})

    @property
    def webhook_url_list(self) -> list[str]:
        """The external receivers of incident notifications (``webhook_urls``; none by default)."""
        return [u.strip() for u in self.webhook_urls.split(",") if u.strip()]

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
        if "scheduler" in self.roles and not secret_ok:  # incident notifications are signed
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
