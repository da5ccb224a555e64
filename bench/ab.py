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
            servers[f"{i}:{tree}"] = run.start_ours(dbs[i].fresh(), Path(tempfile.mkdtemp(prefix="mcp-ab-")))
            results[f"{i}:{tree}"] = []
        run.pin_postgres(run.SERVER_CORE)
        keys = list(servers)
        for r in range(args.rounds):
            for key in keys if r % 2 == 0 else keys[::-1]:
                out = Path(tempfile.mkdtemp(prefix="mcp-ab-")) / "load.json"
                got: dict[str, Any] = run.run_load(servers[key], args.workload, args.seconds, out)
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
    base = None
    for tree, rows in results.items():
        cpu = statistics.median(r[1] for r in rows)
        base = cpu if base is None else base
        print(
            f"{tree}: {statistics.median(r[0] for r in rows):.0f} ops/s, server CPU {cpu:.4f} ms/op "
            f"({cpu / base:.2f}x the first), PostgreSQL {statistics.median(r[2] for r in rows):.4f} ms/op (medians)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
