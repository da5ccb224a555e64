"""make bench: our service (hosted mode: tokens, RLS, audit, metrics) and the best peers side by side.

Each server and its database run on core 0, the load generator on core 1. Servers are started
fresh for every (round, workload, server), in alternating order over the rounds; the report gives
medians as ratios to the best peer and to a bare Starlette floor measured in the same run, and a
scale run of tasks/get latency with 1 thousand to 1 million tasks stored.

    python bench/run.py [--rounds 3] [--duration 10] [--out docs/performance.md] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("MCP_TASKS_SHARED", ROOT.parent / "shared"))
PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
BIN = ROOT / ".venv" / "bin"
ADMIN_DSN = os.environ.get("MCP_TASKS_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SERVER_CORE, LOAD_CORE = "0", "1"

WORKLOADS: dict[str, dict[str, Any]] = {
    "plain": {"clients": 32},
    "lifecycle": {"clients": 32},
    "get": {"clients": 32, "held": 200},
    "create": {"clients": 16},
}
# What each target compares (issue 5): workload -> (metric, target ratio to the best peer).
TARGETS = {"plain": 5.0, "lifecycle": 3.0, "get": 5.0, "create": 3.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(core: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", core, *cmd] if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > 1 else cmd


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited while starting: {url}")
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url, timeout=1)
            return
        time.sleep(0.2)
    raise RuntimeError(f"server did not start: {url}")


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    tokens: list[str] = field(default_factory=list)
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def stop(self) -> None:
        for p in [self.proc, *self.extra]:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


class Databases:
    """A migrated template; a fresh copy for every run of our server; all dropped at the end."""

    def __init__(self) -> None:
        self.template = f"mcp_tasks_bench_tpl_{secrets.token_hex(3)}"
        self.made: list[str] = [self.template]

    def url(self, name: str) -> str:
        return ADMIN_DSN.rsplit("/", 1)[0] + "/" + name

    async def _exec(self, sql: str) -> None:
        conn = await asyncpg.connect(ADMIN_DSN)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def create_template(self) -> None:
        asyncio.run(self._exec(f'CREATE DATABASE "{self.template}"'))
        subprocess.run([str(BIN / "mcp-tasks"), "migrate"], env={**os.environ, "MCP_TASKS_DATABASE_URL": self.url(self.template)},
                       check=True, capture_output=True)  # fmt: skip

    def fresh(self) -> str:
        name = f"mcp_tasks_bench_{secrets.token_hex(4)}"
        asyncio.run(self._exec(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"'))
        self.made.append(name)
        return self.url(name)

    def drop_all(self) -> None:
        for name in reversed(self.made):
            with contextlib.suppress(Exception):
                asyncio.run(self._exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def pin_postgres(core: str) -> None:
    """The database counts as part of the server: pin the local cluster's processes to its core."""
    if not shutil.which("taskset"):
        return
    pids = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True).stdout.split()
    for pid in pids:
        subprocess.run(["taskset", "-a", "-cp", core, pid], capture_output=True)


def start_ours(db_url: str, logs: Path) -> Server:
    issuer_port, port = free_port(), free_port()
    issuer = f"http://127.0.0.1:{issuer_port}"
    url = f"http://127.0.0.1:{port}/mcp"
    env = {**os.environ, "MCP_TASKS_DATA_DIR": str(logs / "issuer"), "MCP_TASKS_PUBLIC_URL": url}
    dev = subprocess.Popen(pinned(LOAD_CORE, [str(BIN / "mcp-tasks"), "dev-issuer", "--port", str(issuer_port)]),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_http(f"{issuer}/jwks", dev)
    server_env = {
        **os.environ,
        "MCP_TASKS_DATABASE_URL": db_url,
        "MCP_TASKS_PORT": str(port),
        "MCP_TASKS_OAUTH_ISSUER": issuer,
        # Operators size these to their load; the defaults are for protection, not for a load test.
        "MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR": "1000000",
        "MCP_TASKS_MAX_ACTIVE_TASKS_PER_TENANT": "10000000",
        "MCP_TASKS_RATE_LIMIT": "10000000/minute",
        "MCP_TASKS_MAX_TTL_MS": "86400000",
        "MCP_TASKS_LOG_LEVEL": "WARNING",
    }
    with (logs / "ours.log").open("ab") as log:
        proc = subprocess.Popen(pinned(SERVER_CORE, [str(BIN / "mcp-tasks"), "serve"]), env=server_env,
                                stdout=log, stderr=log)  # fmt: skip
    wait_http(url.removesuffix("/mcp") + "/healthz", proc)
    tokens = []
    for i in range(32):  # 8 tenants x 4 subjects: many principals, as in production
        tokens.append(subprocess.run(
            [str(BIN / "mcp-tasks"), "token", "--issuer", issuer, "--tenant", f"tenant-{i % 8}",
             "--subject", f"user-{i}", "--resource", url],
            env=env, check=True, capture_output=True, text=True,
        ).stdout.strip())  # fmt: skip
    return Server("ours", url, proc, tokens, [dev])


def start_peer(name: str, logs: Path) -> Server:
    port = free_port()
    script, venv = {"sdk": ("sdk_server.py", "venv-mcp1"), "fastmcp": ("fastmcp_server.py", "venv-fastmcp3")}[name]
    with (logs / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(pinned(SERVER_CORE, [str(PEERS / venv / "bin" / "python"), str(SHARED / "peers" / script), str(port)]),
                                stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    wait_http(url, proc)
    return Server(name, url, proc)


def start_floor(logs: Path) -> Server:
    port = free_port()
    with (logs / "floor.log").open("ab") as log:
        proc = subprocess.Popen(pinned(SERVER_CORE, [str(BIN / "python"), str(ROOT / "bench" / "floor.py"), str(port)]),
                                stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    wait_http(url, proc)
    return Server("floor", url, proc)


class PostgresCpu:
    """CPU seconds of the local PostgreSQL cluster's processes over time (ours runs on it; the peers
    do not), sampled in the background so the measured window can be cut out of setup and clean-up.
    Backends come and go: each process counts with the last CPU time it was seen with."""

    def __init__(self, every_s: float = 0.25) -> None:
        import threading

        self._last: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            for proc in psutil.process_iter(["name", "cpu_times"]):
                times = proc.info["cpu_times"]
                if proc.info["name"] == "postgres" and times is not None:
                    self._last[proc.pid] = times.user + times.system
            self.samples.append((time.time(), sum(self._last.values())))
            self._stop.wait(self._every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> float:
        """Cumulative CPU seconds at wall time t (the last sample before it)."""
        before = [cpu for ts, cpu in self.samples if ts <= t]
        return before[-1] if before else (self.samples[0][1] if self.samples else 0.0)


def run_load(server: Server, workload: str, duration: float, out: Path, profile: Path | None = None) -> dict[str, Any]:
    cfg = WORKLOADS[workload]
    cmd = [str(BIN / "mcp-tasks"), "bench", "--url", server.url, "--workload", workload,
           "--clients", str(cfg["clients"]), "--duration", str(duration), "--server-pid", str(server.proc.pid),
           "--json", str(out), "--quiet"]  # fmt: skip
    if "held" in cfg:
        cmd += ["--held", str(cfg["held"])]
    for token in server.tokens:
        cmd += ["--token", token]
    db = PostgresCpu() if server.name == "ours" else None
    spy = None
    if profile is not None:  # sampling costs the server a little CPU: profile runs are not for the report
        profile.parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(pinned(LOAD_CORE, [str(BIN / "py-spy"), "record", "--pid", str(server.proc.pid), "--output", str(profile),
                                                  "--duration", str(int(duration) + 5), "--format", "raw", "--nonblocking"]),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    subprocess.run(pinned(LOAD_CORE, cmd), capture_output=True, timeout=duration * 10 + 600)
    if spy is not None:
        spy.send_signal(2)
        spy.wait(timeout=60)
    if db is not None:
        db.stop()
    if not out.exists():
        return {"error": "the load generator produced no result"}
    result: dict[str, Any] = json.loads(out.read_text())
    if db is not None and result.get("ops") and result.get("window_unix"):
        begin, end = result["window_unix"]
        result["db_cpu_ms_per_op"] = 1000 * (db.at(end) - db.at(begin)) / result["ops"]
    return result


@contextlib.contextmanager
def started(name: str, dbs: Databases, logs: Path) -> Iterator[Server]:
    server = (
        start_ours(dbs.fresh(), logs)
        if name == "ours"
        else start_floor(logs)
        if name == "floor"
        else start_peer(name, logs)
    )
    try:
        yield server
    finally:
        server.stop()


def ensure_peers() -> list[str]:
    """Install the peers outside the project tree (idempotent); return the ones that are usable."""
    subprocess.run(["bash", str(ROOT / "scripts" / "install-peers.sh")], env={**os.environ, "PEERS_SRC": str(SHARED / "peers")},
                   check=True, capture_output=True)  # fmt: skip
    venv = PEERS / "venv-fastmcp3"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "fastmcp[tasks]==3.4.11"], check=True, capture_output=True
        )
    return ["sdk", "fastmcp"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--out", default="/var/tmp/mcp-tasks-bench-results.json", help="raw results (JSON)")
    ap.add_argument("--smoke", action="store_true", help="one short round, ours and the floor only (CI)")
    ap.add_argument("--no-scale", action="store_true", help="skip the 1k/100k/1M stored-tasks scale run")
    ap.add_argument("--servers", help="comma-separated subset of ours,sdk,fastmcp,floor (default: all)")
    ap.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    ap.add_argument("--profile", metavar="DIR", help="record py-spy folded stacks of our service per run")
    args = ap.parse_args()
    only = set(args.servers.split(",")) if args.servers else None
    workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    peers = [] if args.smoke or (only is not None and not only & {"sdk", "fastmcp"}) else ensure_peers()
    rounds, duration = (1, 1.0) if args.smoke else (args.rounds, args.duration)
    logs = Path(tempfile.mkdtemp(prefix="mcp-tasks-bench-", dir="/var/tmp"))
    dbs = Databases()
    dbs.create_template()
    if not args.smoke:
        pin_postgres(SERVER_CORE)
        if (os.cpu_count() or 1) > 1:  # this script's own sampling stays off the servers' core
            os.sched_setaffinity(0, {int(LOAD_CORE)})
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for r in range(rounds):
            servers = ["ours", *peers]
            servers = servers if r % 2 == 0 else list(reversed(servers))  # alternate who goes first
            for workload in workloads:
                names = [*servers, "floor"] if workload == "plain" else servers
                for name in (n for n in names if only is None or n in only):
                    with started(name, dbs, logs) as server:
                        out = logs / f"{name}-{workload}-{r}.json"
                        profile = (
                            Path(args.profile) / f"{workload}-{r}.folded" if args.profile and name == "ours" else None
                        )
                        result = run_load(server, workload, duration, out, profile)
                    results.setdefault(workload, {}).setdefault(name, []).append(result)
                    print(f"round {r + 1} {workload:9} {name:8} {summary(result)}", file=sys.stderr, flush=True)
        scale = {} if args.smoke or args.no_scale else scale_run(dbs, logs, duration)
    finally:
        if not args.smoke:
            pin_postgres("0-" + str((os.cpu_count() or 1) - 1))
        dbs.drop_all()
    report = {"results": results, "scale": scale, "rounds": rounds, "duration_s": duration}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(render(report))
    failed = sum(x.get("errors", 1) for per in results.values() for runs in per.values() for x in runs)
    return 1 if failed else 0


def summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return result["error"]
    server = result.get("server") or {}
    return (f"{result['throughput_per_s']:9.1f} ops/s  errors={result['errors']}  "
            f"cpu/op={server.get('cpu_ms_per_op', float('nan')):.3f} ms  "
            f"db-cpu/op={result.get('db_cpu_ms_per_op', float('nan')):.3f} ms")  # fmt: skip


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else float("nan")


def _num(v: float, fmt: str = ".0f", suffix: str = "") -> str:
    return "-" if v != v else f"{v:{fmt}}{suffix}"  # NaN (not measured) prints as a dash


def render(report: dict[str, Any]) -> str:
    """A markdown table of medians and ratios (pasted into docs/performance.md)."""
    lines = [
        "| workload | ours | official SDK | FastMCP | floor | ours / best peer | target |",
        "|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for workload, per in report["results"].items():
        value = {name: median_of(runs, "throughput_per_s") for name, runs in per.items()}
        peers = [v for k, v in value.items() if k in ("sdk", "fastmcp")]
        ratio = value.get("ours", nan) / max(peers) if peers else nan
        cells = [_num(value.get(k, nan)) for k in ("ours", "sdk", "fastmcp", "floor")]
        lines.append(f"| {workload} | {' | '.join(cells)} | {_num(ratio, '.2f', 'x')} | >= {TARGETS[workload]:.0f}x |")
    lines += ["", "Server CPU per operation, ms (ours: Python + PostgreSQL):", "",
              "| workload | ours | official SDK | FastMCP | floor |", "|---|---|---|---|---|"]  # fmt: skip
    for workload, per in report["results"].items():
        cpu = {name: statistics.median([(r.get("server") or {}).get("cpu_ms_per_op", nan) for r in runs] or [nan])
               for name, runs in per.items()}  # fmt: skip
        db = median_of(per.get("ours", []), "db_cpu_ms_per_op")
        ours = f"{_num(cpu.get('ours', nan), '.2f')} + {_num(db, '.2f')}"
        rest = [_num(cpu.get(k, nan), ".2f") for k in ("sdk", "fastmcp", "floor")]
        lines.append(f"| {workload} | {ours} | {' | '.join(rest)} |")
    for stored, p99 in (report.get("scale") or {}).items():
        lines.append(f"\ntasks/get p99 with {stored} tasks stored: {_num(p99, '.2f')} ms")
    return "\n".join(lines)


def scale_run(dbs: Databases, logs: Path, duration: float) -> dict[str, float]:
    """tasks/get p99 with 1 thousand, 100 thousand and 1 million other tasks stored."""
    out: dict[str, float] = {}
    for stored in (1_000, 100_000, 1_000_000):
        db_url = dbs.fresh()
        asyncio.run(fill(db_url, stored))
        with started_ours_on(db_url, logs) as server:
            result = run_load(server, "get", duration, logs / f"scale-{stored}.json")
        out[f"{stored:,}"] = result.get("methods", {}).get("tasks/get", {}).get("p99_ms", float("nan"))
        print(f"scale {stored:>9,} stored: tasks/get p99 {out[f'{stored:,}']:.2f} ms", file=sys.stderr, flush=True)
    return out


@contextlib.contextmanager
def started_ours_on(db_url: str, logs: Path) -> Iterator[Server]:
    server = start_ours(db_url, logs)
    try:
        yield server
    finally:
        server.stop()


async def fill(db_url: str, n: int) -> None:
    """Completed tasks of other tenants (RLS keeps them out of every query but the indexes)."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(
            """
            INSERT INTO tasks (tenant_id, task_id, subject, surface, tool, arguments, status, outcome, payload,
                               ttl_ms, poll_interval_ms, expires_at, created_at, last_updated_at)
            SELECT 'filler-' || (i % 1000), md5(i::text) || md5((i + 1)::text), 'user-' || (i % 50), '2025-11-25',
                   'echo', '{"text":"x"}', 'completed', 'result', '{"content":[{"type":"text","text":"x"}]}',
                   86400000, 1000, now() + interval '1 day', now() - (i || ' ms')::interval, now()
            FROM generate_series(1, $1) AS i
            """,
            n,
        )
        await conn.execute("ANALYZE tasks")
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.exit(main())
