"""Before/after of our server on a noisy machine: both trees' servers up at once, short loads alternated.

On a shared virtual machine the speed drifts by 20-30 % over minutes, so two `bench/run.py
--server-tree` runs minutes apart cannot tell a 5-10 % change. Here both servers (each tree's code,
its own fresh database, pinned with PostgreSQL to core 0 as in `make bench`) stay up, and loads of a
few seconds go to one and then the other, the order swapped every round; the medians of each tree's
server CPU per operation and throughput are compared. An A/A run (one tree twice) measures what is
left of the noise (about 5 % on the AMD EPYC machine of the tenth pass).

    .venv/bin/python bench/ab.py --workload plain --rounds 8 --seconds 4 /tmp/before /tmp/after

Each tree is a worktree sharing this venv (`git worktree add /tmp/before <commit> && ln -s
"$PWD/.venv" /tmp/before/.venv`). Nothing here is a verdict: `make bench` gives those.

With ``--fresh`` every load gets a server and database of its own, started for it and stopped after
it, as `make bench` runs them: each tree is then measured as a fresh deployment, not after the
minutes of load the rounds before left in its database (an early tree's plans may degrade as its
tables fill). Slower (a start per load, some 20 s); both ways are worth a look.
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
    ap.add_argument("trees", nargs="+", help="checkouts of our server (worktrees sharing this venv)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers
    # Each tree runs on the schema its own migrations make: an earlier tree's server on today's
    # functions would measure its Python with today's SQL.
    dbs = [run.Databases() for _ in args.trees]
    servers: dict[str, run.Server] = {}
    results: dict[str, list[tuple[float, float, float]]] = {}
    try:
        for i, tree in enumerate(args.trees):
            run.SERVER_TREE = tree
            dbs[i].create_template()
            if not args.fresh:
                servers[f"{i}:{tree}"] = run.start_ours(dbs[i].fresh(), Path(tempfile.mkdtemp(prefix="mcp-ab-")))
            results[f"{i}:{tree}"] = []
        run.pin_postgres(run.SERVER_CORE)
        keys = list(results)
        for r in range(args.rounds):
            for key in keys if r % 2 == 0 else keys[::-1]:
                out = Path(tempfile.mkdtemp(prefix="mcp-ab-")) / "load.json"
                if args.fresh:
                    i = keys.index(key)
                    run.SERVER_TREE = args.trees[i]
                    servers[key] = run.start_ours(dbs[i].fresh(), out.parent)
                try:
                    got: dict[str, Any] = run.run_load(servers[key], args.workload, args.seconds, out)
                finally:
                    if args.fresh:
                        servers.pop(key).stop()
                if "error" in got:
                    print(f"{key}: {got['error']}", file=sys.stderr)
                    return 1
                row = (got["throughput_per_s"], got["server"]["cpu_ms_per_op"], got.get("db_cpu_ms_per_op") or 0.0)
                results[key].append(row)
                print(f"round {r + 1} {key}: {row[0]:.0f} ops/s, {row[1]:.4f} + {row[2]:.4f} ms/op", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        for made in dbs:
            made.drop_all()
    first = results[keys[0]]
    for tree, rows in results.items():
        cpu = statistics.median(r[1] for r in rows)
        db = statistics.median(r[2] for r in rows)
        line = f"{tree}: medians {statistics.median(r[0] for r in rows):.0f} ops/s, server CPU {cpu:.4f} ms/op, PostgreSQL {db:.4f} ms/op"
        if rows is not first:
            # Server + PostgreSQL against the first tree: the median of the rounds' ratios (each
            # round's loads minutes apart at most), and the ratio of the medians.
            per_round = [(a[1] + a[2]) / (b[1] + b[2]) for a, b in zip(rows, first, strict=True)]
            whole = (cpu + db) / statistics.median(r[1] + r[2] for r in first)
            line += (f"; server + PostgreSQL {statistics.median(per_round):.3f}x the first (median of the rounds'"
                     f" ratios, {min(per_round):.2f}-{max(per_round):.2f}), {whole:.3f}x (ratio of the medians)")  # fmt: skip
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
