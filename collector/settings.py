"""Collector settings: the store DSN, ingest tokens, the spool and the block writer (env ``LIVESTEP_*``).

    settings = CollectorSettings()                      # from the environment
    settings = CollectorSettings(spool_dir=tmp_path)    # in tests

``api.settings.Settings`` extends this class with the server's bind address and role, and refuses
to start on a non-loopback bind without ingest tokens.

Where data lives by default (``data_home()``): ``$LIVESTEP_HOME`` when set, else ``./var`` of the
working directory, resolved to an absolute path when the settings are read -- never the installed
package's folder (a wheel's ``site-packages``). The store is ``<home>/chdb``, the spool ``<home>/spool``,
reports ``<home>/reports``; each has its own variable too (``LIVESTEP_CLICKHOUSE_DSN``,
``LIVESTEP_SPOOL_DIR``, ``LIVESTEP_REPORTS_DIR``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

REPO_DIR = Path(__file__).resolve().parent.parent  # the source checkout (bench/, docs/): never a data default
HOME_ENV = "LIVESTEP_HOME"
MiB = 1024 * 1024


def data_home() -> Path:
    """The folder of livestep's data by default: ``$LIVESTEP_HOME``, else ``./var`` of the working directory."""
    env = os.environ.get(HOME_ENV, "").strip()
    return (Path(env).expanduser() if env else Path.cwd() / "var").resolve()


def default_paths() -> dict[str, str]:
    """The defaults as the help texts show them (resolved now, from this working directory)."""
    home = data_home()
    return {"home": str(home), "dsn": f"chdb://{home / 'chdb'}", "spool": str(home / "spool"),
            "reports": str(home / "reports")}

# token lists read from the env as a comma-separated string (or a JSON list)
TokenList = Annotated[list[str], NoDecode]


def split_tokens(v):
    """'a,b' or '["a","b"]' or a list -> a list of non-empty, stripped tokens."""
    if isinstance(v, str):
        v = v.strip()
        if v.startswith("["):
            import json

            v = json.loads(v)
        else:
            v = v.split(",")
    return [t.strip() for t in v if t and t.strip()]


class CollectorSettings(BaseSettings):
    """Everything the ingest path needs; each field is bounded and documented."""

    model_config = SettingsConfigDict(env_prefix="LIVESTEP_", extra="ignore", validate_default=True)

    clickhouse_dsn: str = Field(
        default_factory=lambda: f"chdb://{data_home() / 'chdb'}",
        min_length=7,
        max_length=2048,
        description="store DSN: chdb:///abs/dir[?database=name] (embedded) or http(s)://user:pass@host:port/db",
    )
    cluster: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="ClickHouse cluster the store's tables live on (sql/ in its cluster form, applied by `livestep migrate "
        "--cluster NAME`); set, the server never applies DDL at start and refuses a schema that is not current",
    )
    migrate_on_start: bool = Field(
        default=True,
        description="without a cluster, apply pending single-node migrations (sql/) at start; false: only check "
        "(run `livestep migrate` in the upgrade step)",
    )
    ingest_tokens: TokenList = Field(
        default_factory=list,
        max_length=1024,
        description="bearer tokens accepted by POST /v1/telemetry (comma-separated in the env); "
        "empty = no auth, allowed only on a loopback bind",
    )
    spool_dir: Path = Field(
        default_factory=lambda: data_home() / "spool",
        description="directory of the durable spool (append-only fsync'd segments); one per collector process",
    )
    spool_max_bytes: int = Field(
        default=1024 * MiB,
        ge=MiB,
        le=1024 * 1024 * MiB,
        description="bytes of not-yet-stored batches the spool holds; beyond it ingest answers 429 + Retry-After",
    )
    spool_segment_bytes: int = Field(
        default=64 * MiB,
        ge=64 * 1024,
        le=4096 * MiB,
        description="a spool segment file is closed and a new one started past this size",
    )
    max_body_bytes: int = Field(
        default=32 * MiB,
        ge=1024,
        le=1024 * MiB,
        description="largest accepted request body; a bigger one gets 413",
    )
    max_decoded_bytes: int = Field(
        default=64 * MiB,
        ge=1024,
        le=4096 * MiB,
        description="most bytes an Arrow IPC body may decode to (its buffers decompressed: zstd, lz4); "
        "read from the stream's metadata before decoding, a body over it gets 413",
    )
    flush_rows: int = Field(
        default=200_000,
        ge=1,
        le=10_000_000,
        description="the writer inserts a block once this many spooled rows are waiting (merged across requests); "
        "fewer, larger blocks leave chDB fewer parts to merge",
    )
    flush_interval_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="... or once the oldest waiting batch is this old",
    )
    retry_max_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="the writer's retry backoff (exponential, jittered) while the store is down never exceeds this",
    )
    poison_after_failures: int = Field(
        default=20,
        ge=2,
        le=100_000,
        description="a block the store refuses this many times while answering pings is retried batch by batch; "
        "batches still refused go to <spool_dir>/quarantine (Arrow IPC, re-sendable) instead of blocking the rest",
    )
    idempotency_keys: int = Field(
        default=1_000_000,
        ge=1000,
        le=100_000_000,
        description="how many recent batch ids are remembered (a retried batch within them is acked as duplicate)",
    )
    fault_refuse_writes_file: Path | None = Field(
        default=None,
        description="TEST/DRILL ONLY: while this file exists every insert fails as a store refusing writes "
        "would (ClickHouse's TOO_MANY_PARTS) while pings still answer (bench/faults.py); None disables the hook",
    )
    fault_store_down_file: Path | None = Field(
        default=None,
        description="TEST/DRILL ONLY: while this file exists the writer treats the store as unavailable "
        "(rows stay in the spool); None disables the hook",
    )
    fault_pause_before_commit_file: Path | None = Field(
        default=None,
        description="TEST/DRILL ONLY: while this file exists the writer stops after a block is in the store and "
        "before its spool commit, and says so by creating <file>.paused (bench/faults.py aims kill -9 there); "
        "None disables the hook",
    )

    @field_validator("ingest_tokens", mode="before")
    @classmethod
    def _split_ingest_tokens(cls, v):
        return split_tokens(v)
