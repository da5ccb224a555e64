"""Before/after of our server on a noisy machine: the trees' loads alternated, round after round.

On a shared virtual machine the speed drifts by 20-30 % over minutes, so two `bench/run.py
--server-tree` runs minutes apart cannot tell a 5-10 % change. Here loads of a few seconds go to
each tree in turn (each tree's code on a database made by its own migrations, pinned with
PostgreSQL to core 0 as in `make bench`), the order swapped every round. Each tree's throughput,
server CPU and PostgreSQL CPU per operation are reported as medians, and server + PostgreSQL CPU
against the first tree both as the median of the rounds' ratios and as the ratio of the medians.
An A/A run (one tree twice) measures what is left of the noise (about 5 % on an AMD EPYC machine,
1bd624b).

    .venv/bin/python bench/ab.py --workload plain --rounds 8 --seconds 4 /tmp/before /tmp/after

Each tree is a worktree sharing this venv (`git worktree add /tmp/before <commit> && ln -s
"$PWD/.venv" /tmp/before/.venv`). Nothing here is a verdict: `make bench` gives those.

By default each tree's server and database stay up for the whole run, so a load meets what the
rounds before left in its tables. That suits a small change between two trees of one schema. With
``--fresh`` every load gets a server and a database started for it and dropped after it, as `make
bench` runs them: use it against an older tree whose plans may degrade as its tables fill (issue
15's baseline `2b534eb`, whose PostgreSQL CPU per lifecycle read 31-39 % higher without it:
6211ccd). It costs some 20 s more per load. If a load fails, the rounds every tree completed are
still summarised.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # bench/run.py: the same servers, databases, pinning and load generator


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="plain", choices=sorted(run.WORKLOADS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each load (default %(default)s)")
    ap.add_argument("--fresh", action="store_true", help="a fresh server and database for every load")
    ap.add_argument("--env", action="append", default=[], type=run.tree_env, metavar="N:KEY=VALUE", help="a variable for the "
                    "server of the Nth tree (from 0), e.g. 1:OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 with "
                    "bench/otlp_sink.py listening there: one tree twice, tracing off and on")  # fmt: skip
    ap.add_argument("trees", nargs="+", help="checkouts of our server (worktrees sharing this venv)")
    args = ap.parse_args()
    extra = run.envs_by_tree(args.env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers
    # Each tree runs on the schema its own migrations make: an earlier tree's server on today's
    # functions would measure its Python with today's SQL.
    dbs = [run.Databases() for _ in args.trees]
    keys = [f"{i}:{tree}" for i, tree in enumerate(args.trees)]
    servers: dict[str, run.Server] = {}
    results: dict[str, list[tuple[float, float, float]]] = {key: [] for key in keys}
    failed = False
    try:
        for i, tree in enumerate(args.trees):
            run.SERVER_TREE = tree
            dbs[i].create_template()
            if not args.fresh:
                servers[keys[i]] = run.start_ours(dbs[i].fresh(), Path(tempfile.mkdtemp(prefix="mcp-ab-")),
                                                  {**workload_env(args.workload), **extra.get(i, {})})  # fmt: skip
        run.pin_postgres(run.SERVER_CORE)  # a fresh server's backends inherit the postmaster's pinning
        for r in range(args.rounds):
            for key in keys if r % 2 == 0 else keys[::-1]:
                i = keys.index(key)
                got = load(args, dbs[i], servers, key, args.trees[i])
                if "error" in got:
                    print(f"{key}: {got['error']}", file=sys.stderr)
                    failed = True
                    break
                row = (got["throughput_per_s"], got["server"]["cpu_ms_per_op"], got.get("db_cpu_ms_per_op") or 0.0)
                results[key].append(row)
                print(f"round {r + 1} {key}: {row[0]:.0f} ops/s, {row[1]:.4f} + {row[2]:.4f} ms/op", flush=True)
            if failed:
                break
    finally:
        for server in servers.values():
            server.stop()
        for made in dbs:
            made.drop_all()
    summarise(keys, results)
    return 1 if failed else 0


def load(
    args: argparse.Namespace, db: run.Databases, servers: dict[str, run.Server], key: str, tree: str
) -> dict[str, Any]:
    """One load on ``tree``: on its server, or (``--fresh``) on one started for it and dropped after."""
    out = Path(tempfile.mkdtemp(prefix="mcp-ab-")) / "load.json"
    if not args.fresh:
        return run.run_load(servers[key], args.workload, args.seconds, out)
    run.SERVER_TREE = tree
    url = db.fresh()
    try:
        servers[key] = run.start_ours(url, out.parent, workload_env(args.workload))
        return run.run_load(servers[key], args.workload, args.seconds, out)
    finally:
        if key in servers:
            servers.pop(key).stop()
        db.drop(url)


def workload_env(workload: str) -> dict[str, str]:
    """What ``make bench`` starts our server with for the workload (a 2026-07-28 one: no grace)."""
    return dict(run.EXT_ENV) if workload in run.EXT_WORKLOADS else {}


def summarise(keys: list[str], results: dict[str, list[tuple[float, float, float]]]) -> None:
    """Medians per tree over the rounds every tree completed; server + PostgreSQL CPU against the
    first tree as the median of the rounds' ratios (each round's loads minutes apart at most) and
    as the ratio of the medians."""
    rounds = min(len(rows) for rows in results.values())
    if rounds == 0:
        print("no round completed", file=sys.stderr)
        return
    first = results[keys[0]][:rounds]
    for key in keys:
        rows = results[key][:rounds]
        cpu = statistics.median(r[1] for r in rows)
        db = statistics.median(r[2] for r in rows)
        line = (f"{key}: medians of {rounds} rounds {statistics.median(r[0] for r in rows):.0f} ops/s, "
                f"server CPU {cpu:.4f} ms/op, PostgreSQL {db:.4f} ms/op")  # fmt: skip
        if key != keys[0]:
            per_round = [(a[1] + a[2]) / (b[1] + b[2]) for a, b in zip(rows, first, strict=True)]
            whole = (cpu + db) / statistics.median(r[1] + r[2] for r in first)
            line += (f"; server + PostgreSQL {statistics.median(per_round):.3f}x the first (median of the rounds'"
                     f" ratios, {min(per_round):.2f}-{max(per_round):.2f}), {whole:.3f}x (ratio of the medians)")  # fmt: skip
        print(line)


if __name__ == "__main__":
    sys.exit(main())
