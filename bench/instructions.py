"""Instructions per operation of our server, counted by callgrind: a before/after that machine noise cannot blur.

Wall-clock and CPU-time A/Bs on a shared machine move by 5-30 % between runs (bench/ab.py); the
instructions a process executes for the same requests hardly do (1-2 % between two servers of the
same tree or two counts of one; the smaller count is reported). Each tree's server runs under
``valgrind --tool=callgrind`` (hosted mode with tokens, as ``make bench`` runs it, on its own
database made by its own migrations), with counting off until one client on one keep-alive
connection has warmed it up; then ``--ops`` operations are counted, one at a time, and the count
divided by them. Repeats reuse the server.

    .venv/bin/python bench/instructions.py --workload plain --ops 1000 /tmp/before .

Counts, not seconds: what the process itself executes, in Python and the C under it (uvloop,
httptools, asyncpg, orjson), not the kernel's share of its socket calls nor PostgreSQL's work.
Under valgrind a hashing library may take a slower path than on the real CPU (SHA-256 without
SHA-NI). One operation at a time: a group-commit statement carries one request, so the
per-statement costs of ``lifecycle`` weigh more than under load (bench/ab.py measures those).
Nothing here is a verdict: ``make bench`` gives those.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # bench/run.py: the same databases, tokens and server settings

ACCEPT = "application/json, text/event-stream"


class Client:
    """One MCP session on one keep-alive connection (2025-11-25)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.http = httpx.Client(timeout=600)
        base = {"Accept": ACCEPT, "Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        init = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "instructions", "version": "0"},
        }
        r = self.http.post(url, headers=base, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init})
        r.raise_for_status()
        self.headers = {**base, "Mcp-Session-Id": r.headers["mcp-session-id"], "MCP-Protocol-Version": "2025-11-25"}
        self.http.post(url, headers=self.headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.next_id = 1

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        body = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        reply = self.http.post(self.url, headers=self.headers, json=body).json()
        if "result" not in reply:
            raise RuntimeError(f"{method}: {reply}")
        result: dict[str, Any] = reply["result"]
        return result

    def plain(self) -> None:
        self.call("tools/call", {"name": "echo", "arguments": {"text": "x"}})

    def lifecycle(self) -> None:
        created = self.call("tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": {"ttl": 60_000}})
        task = {"taskId": created["task"]["taskId"]}
        self.call("tasks/get", task)
        self.call("tasks/result", task)


def callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def counted(out: Path, dump: int) -> int:
    """The instruction total of the ``dump``-th dump of the server's profile (callgrind's summary line)."""
    for line in Path(f"{out}.{dump}").read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {out}.{dump}")


def measure(tree: str, workload: str, ops: int, repeats: int, env: dict[str, str] | None = None) -> list[float]:
    run.SERVER_TREE = str(Path(tree).resolve())
    dbs = run.Databases()
    logs = Path(tempfile.mkdtemp(prefix="mcp-instructions-"))
    out = logs / "callgrind.out"
    wrap = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        str(run.BIN / "python"),
    ]
    server = None
    try:
        dbs.create_template()
        server = run.start_ours(dbs.fresh(), logs, env, principals=1, wrap=wrap, start_timeout=600)
        pid = server.proc.pid
        client = Client(server.url, server.tokens[0])
        op = client.plain if workload == "plain" else client.lifecycle
        for _ in range(50):  # warm: tokens, sessions, plans and caches, as a running server has them
            op()
        per_op = []
        for dump in range(1, repeats + 1):
            callgrind(pid, "-i", "on")
            callgrind(pid, "-z")
            for _ in range(ops):
                op()
            callgrind(pid, "-d")
            callgrind(pid, "-i", "off")
            per_op.append(counted(out, dump) / ops)
            print(f"{tree} {workload}: {per_op[-1]:,.0f} instructions per operation", flush=True)
        return per_op
    finally:
        if server is not None:
            server.stop()
        dbs.drop_all()
        with contextlib.suppress(OSError):
            shutil.rmtree(logs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="plain", choices=["plain", "lifecycle"])
    ap.add_argument("--ops", type=int, default=1000, help="operations counted per repeat (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], type=run.tree_env, metavar="N:KEY=VALUE", help="a variable for the "
                    "server of the Nth tree (from 0), as bench/ab.py's: one tree twice, tracing off and on")  # fmt: skip
    ap.add_argument("trees", nargs="+", help="checkouts of our server (worktrees sharing this venv)")
    args = ap.parse_args()
    extra = run.envs_by_tree(args.env)
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    started = time.monotonic()
    results = {f"{i}:{tree}": min(measure(tree, args.workload, args.ops, args.repeats, extra.get(i)))
               for i, tree in enumerate(args.trees)}  # fmt: skip
    first = next(iter(results.values()))
    for tree, value in results.items():
        print(f"{tree}: {value:,.0f} instructions per {args.workload} ({value / first:.3f}x the first)")
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
