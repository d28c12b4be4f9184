"""``livestep migrate``: apply the schema to the store and record it (collector/migrations.py).

    livestep migrate                                      # sql/ on LIVESTEP_CLICKHOUSE_DSN (one node)
    livestep migrate --dsn https://admin:pw@ch1:8443/livestep --cluster main   # sql/ in its cluster form ON CLUSTER 'main'
    livestep migrate --cluster main --dry-run             # print the DDL and parse-check it, run nothing

Run it before starting (or upgrading) the server roles against a ClickHouse cluster: with
``LIVESTEP_CLUSTER`` set they never apply DDL, and refuse a schema that is not current. On chDB the
server applies ``sql/`` itself at start; stop it first (one process per chDB directory).
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("migrate", help="apply the schema (sql/, or its cluster form) and record it",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from collector.settings import default_paths

    p.add_argument("--dsn", help=f"store DSN (default LIVESTEP_CLICKHOUSE_DSN, else chdb://<LIVESTEP_HOME or "
                   f"./var>/chdb: here {default_paths()['dsn']})")
    p.add_argument("--cluster", help="apply sql/ in its cluster form (Replicated + Distributed) ON CLUSTER this name (default LIVESTEP_CLUSTER; "
                                     "none: the single-node sql/)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the pending files' statements and parse-check them on the store; apply nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from collector.migrations import layout_of, migrate
    from collector.settings import CollectorSettings
    from collector.store import open_store

    env = CollectorSettings()
    cluster = args.cluster or env.cluster
    layout_of(cluster)  # a bad name is refused before the store is opened
    store = open_store(args.dsn or env.clickhouse_dsn)
    where = f"{store.dsn.redacted()} ({layout_of(cluster)})"
    steps = migrate(store, cluster=cluster, dry_run=args.dry_run)
    if args.dry_run:
        for step in steps:
            print(f"-- {step.name}: {len(step.statements)} statement(s)")
            for stmt in step.statements:
                print(stmt + ";\n")
        print(f"dry run: {len(steps)} migration(s) pending on {where}; every statement parses; nothing applied")
        return 0
    for step in steps:
        print(f"applied {step.name} ({len(step.statements)} statement(s))")
    print(f"{where}: {len(steps)} migration(s) applied; schema current" if steps else f"{where}: schema current")
    return 0
