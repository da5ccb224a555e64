"""make bench: our service (hosted mode: tokens, RLS, audit, metrics) and the best peers side by side.

Each server and its database run on core 0, the load generator on core 1. Servers are started
fresh for every (round, workload, server), in alternating order over the rounds; the report gives
medians as ratios to the best peer and to a bare Starlette floor measured in the same run, and a
scale run of tasks/get latency with 1 thousand to 1 million tasks stored. The 2025-11-25 workloads
run against the official SDK and FastMCP 3 peers, the 2026-07-28 Tasks extension ones (``ext-*``)
against the fastmcp-tasks 4.1.4 peer, in the same run and pinning.

    python bench/run.py [--rounds 3] [--duration 10] [--doc docs/performance.md] [--smoke]
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("MCP_TASKS_SHARED", ROOT.parent / "shared"))
PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
BIN = ROOT / ".venv" / "bin"
# --server-tree: our server (and its migrations) from another checkout, e.g. a worktree of an
# earlier commit, measured by this harness: before/after on one machine in one session.
SERVER_TREE: str | None = None
# --spy-blocking: py-spy pauses the server for each sample (exact stacks, more overhead).
SPY_BLOCKING = False
SPY_NATIVE = False  # --spy-native: py-spy --native (C frames of asyncpg, json, httptools)


def ours_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of our server's processes: ``--server-tree`` first on their import path."""
    if SERVER_TREE is None:
        return base
    return {**base, "PYTHONPATH": SERVER_TREE}


ADMIN_DSN = os.environ.get("MCP_TASKS_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SERVER_CORE, LOAD_CORE = "0", "1"

WORKLOADS: dict[str, dict[str, Any]] = {
    "plain": {"clients": 32},
    "lifecycle": {"clients": 32},
    "get": {"clients": 32, "held": 200},
    "create": {"clients": 16},
    "ext-lifecycle": {"clients": 32},
    "ext-get": {"clients": 32, "held": 200},
}
# The one-principal variants (issue 15): the same load with every client on one token (one tenant,
# one subject, as a SaaS tenant's agents under one service identity, or single-user mode), judged
# against the spread one (32 principals) of the same run: ours only.
ONE_PRINCIPAL = {"get-1p": "get", "lifecycle-1p": "lifecycle", "create-1p": "create"}
for _variant, _base in ONE_PRINCIPAL.items():
    WORKLOADS[_variant] = {**WORKLOADS[_base], "base": _base, "principals": 1}
# The upstream hop (issue 41): the lifecycle load on an echo tool of an upstream MCP server behind
# ours (tests/upstream_server.py, the official SDK's FastMCP, on the load core: another machine's
# stand-in), right after ours' local lifecycle of the same round: ours only.
HOP = {"lifecycle-up": "lifecycle"}
WORKLOADS["lifecycle-up"] = {**WORKLOADS["lifecycle"], "base": "lifecycle", "tool": "up.echo"}
HOP_TARGET, HOP_P50_TARGET_MS = 0.5, 5.0  # upstream lifecycles over local ones; p50 added
# Tracing (issue 44): the lifecycle load with tracing on and the default sampler (parent-based,
# 10 %: the load sends no trace context), its spans exported over OTLP/HTTP to a sink on the load
# core (bench/otlp_sink.py), right after ours' untraced lifecycle of the same round: ours only.
TRACED = {"lifecycle-traced": "lifecycle"}
WORKLOADS["lifecycle-traced"] = {**WORKLOADS["lifecycle"], "base": "lifecycle"}
TRACED_TARGET = 0.95  # traced lifecycles over untraced ones: tracing costs at most 5 %
ONE_PRINCIPAL_TARGET = 0.9  # one principal's throughput over the spread one's
BUSY_TARGET = 0.9  # ... with the server's core (our process and PostgreSQL, both pinned there) this busy
# What each target compares (issues 5, 11 and 15): workload -> target ratio to the best peer.
TARGETS = {"plain": 5.0, "lifecycle": 4.0, "get": 25.0, "create": 8.0, "ext-lifecycle": 5.0, "ext-get": 10.0}
FLOOR_TARGET = 0.5  # plain tools/call over the bare Starlette floor (issue 15)
# Who is compared on which wire: the 2025-11-25 peers do not speak the extension, the extension
# peer serves no 2025-11-25 Tasks.
LEGACY_PEERS, EXT_PEERS = ("sdk", "fastmcp"), ("fastmcp4",)
EXT_WORKLOADS = ("ext-lifecycle", "ext-get")
PEER_NAMES = {"sdk": "official SDK", "fastmcp": "FastMCP", "fastmcp4": "fastmcp-tasks"}
# ext-lifecycle: the demo `sleep` tool of each side for 1 ms (ours answers sleep(0) or echo within
# the call even with no grace: no task), tasks/get at once and then every 5 ms (--ext-poll-ms)
# until completed.
EXT_TASK_SECONDS, EXT_POLL_MS = 0.005, 5.0


def peers_of(workload: str) -> tuple[str, ...]:
    if workload in ONE_PRINCIPAL or workload in HOP or workload in TRACED:
        return ()
    return EXT_PEERS if workload in EXT_WORKLOADS else LEGACY_PEERS


def machine() -> dict[str, Any]:
    """What the run ran on (CPU model, cores, memory): ratios carry from one machine to another,
    absolute numbers do not."""
    model, mem_kib = "unknown", 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    return {"cpu_model": model, "cores": os.cpu_count() or 1, "memory_gib": round(mem_kib / 1024 / 1024, 1)}


def machine_text(report: dict[str, Any]) -> str:
    m = report.get("machine")
    if not m:
        return f"{os.cpu_count()} cores"
    return f"{m['cpu_model']}, {m['cores']} cores, {m['memory_gib']:g} GiB"


def tree_env(item: str) -> tuple[int, str, str]:
    """One ``--env N:KEY=VALUE`` of bench/ab.py and bench/instructions.py: a variable for the server
    of the Nth tree given (from 0)."""
    n, colon, pair = item.partition(":")
    key, equals, value = pair.partition("=")
    if not (colon and equals and n.isdigit() and key):
        raise argparse.ArgumentTypeError(f"{item!r}: give N:KEY=VALUE, N the tree's place from 0")
    return int(n), key, value


def envs_by_tree(items: list[tuple[int, str, str]]) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for n, key, value in items:
        out.setdefault(n, {})[key] = value
    return out


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
    upstream: subprocess.Popen[bytes] | None = None  # the hop's upstream MCP server (stopped apart)

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
        subprocess.run([str(BIN / "mcp-tasks"), "migrate"], env=ours_env({**os.environ, "MCP_TASKS_DATABASE_URL": self.url(self.template)}),
                       check=True, capture_output=True)  # fmt: skip

    def fresh(self) -> str:
        name = f"mcp_tasks_bench_{secrets.token_hex(4)}"
        asyncio.run(self._exec(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"'))
        self.made.append(name)
        return self.url(name)

    def drop(self, url: str) -> None:
        """Drop one database that ``fresh`` made (its server stopped)."""
        name = url.rsplit("/", 1)[1]
        with contextlib.suppress(Exception):
            asyncio.run(self._exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        if name in self.made:
            self.made.remove(name)

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


def start_ours(
    db_url: str, logs: Path, extra_env: dict[str, str] | None = None, principals: int = 32,
    wrap: list[str] | None = None, start_timeout: float = 60,
) -> Server:  # fmt: skip
    """Our server, its dev issuer and ``principals`` tokens. ``wrap``: a command our server runs
    under (bench/instructions.py: callgrind), which may make its start slower than ``start_timeout``."""
    issuer_port, port = free_port(), free_port()
    issuer = f"http://127.0.0.1:{issuer_port}"
    url = f"http://127.0.0.1:{port}/mcp"
    env = ours_env({**os.environ, "MCP_TASKS_DATA_DIR": str(logs / "issuer"), "MCP_TASKS_PUBLIC_URL": url})
    dev = subprocess.Popen(pinned(LOAD_CORE, [str(BIN / "mcp-tasks"), "dev-issuer", "--port", str(issuer_port)]),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    proc: subprocess.Popen[bytes] | None = None
    try:
        wait_http(f"{issuer}/jwks", dev)
        server_env = {
            **os.environ,
            "MCP_TASKS_DATABASE_URL": db_url,
            "MCP_TASKS_PORT": str(port),
            "MCP_TASKS_OAUTH_ISSUER": issuer,
            # Operators size these to their load; the defaults are for protection, not for a load test.
            "MCP_TASKS_MAX_ACTIVE_TASKS_PER_REQUESTOR": "1000000",
            "MCP_TASKS_MAX_ACTIVE_TASKS_PER_TENANT": "10000000",
            # The runner's tenant share is such a protection too (a hard cap per tenant, 50 % of the
            # slots by default in hosted mode): left at its default it is what one principal's 32
            # clients meet first, and their tasks wait in the queue for a claim (docs/performance.md).
            "MCP_TASKS_RUNNER_TENANT_SHARE": "100%",
            "MCP_TASKS_RATE_LIMIT": "10000000/minute",
            "MCP_TASKS_MAX_TTL_MS": "86400000",
            "MCP_TASKS_LOG_LEVEL": "WARNING",
            "MCP_TASKS_SHUTDOWN_GRACE_S": "1",  # stopped between runs with tasks held: no drain to wait out
            **(extra_env or {}),
        }
        with (logs / "ours.log").open("ab") as log:
            proc = subprocess.Popen(pinned(SERVER_CORE, [*(wrap or []), str(BIN / "mcp-tasks"), "serve"]),
                                    env=ours_env(server_env), stdout=log, stderr=log)  # fmt: skip
        wait_http(url.removesuffix("/mcp") + "/healthz", proc, timeout=start_timeout)
        tokens = []
        for i in range(principals):  # 8 tenants x 4 subjects: many principals, as in production
            tokens.append(subprocess.run(
                [str(BIN / "mcp-tasks"), "token", "--issuer", issuer, "--tenant", f"tenant-{i % 8}",
                 "--subject", f"user-{i}", "--resource", url],
                env=env, check=True, capture_output=True, text=True,
            ).stdout.strip())  # fmt: skip
    except BaseException:  # a start that failed half-way leaves nothing running
        Server("ours", url, dev, [], [proc] if proc is not None else []).stop()
        raise
    return Server("ours", url, proc, tokens, [dev])


PEER_SERVERS = {
    "sdk": ("sdk_server.py", "venv-mcp1"),
    "fastmcp": ("fastmcp_server.py", "venv-fastmcp3"),
    "fastmcp4": ("fastmcp4_ext_server.py", "venv-fastmcp4"),
}


def start_peer(name: str, logs: Path) -> Server:
    port = free_port()
    script, venv = PEER_SERVERS[name]
    args, tokens = [str(port)], []
    if name == "fastmcp4":
        # Bearer tokens, as ours runs: 32 principals (fastmcp's StaticTokenVerifier, a dict lookup;
        # each token its own sub, and every task is scoped to the token that created it).
        # Hex: a URL-safe token may start with "-", which argparse takes for an option.
        tokens = [secrets.token_hex(24) for _ in range(32)]
        args += [f"--token={','.join(tokens)}"]
    with (logs / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(pinned(SERVER_CORE, [str(PEERS / venv / "bin" / "python"), str(SHARED / "peers" / script), *args]),
                                stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    wait_http(url, proc)
    return Server(name, url, proc, tokens)


def start_floor(logs: Path) -> Server:
    port = free_port()
    with (logs / "floor.log").open("ab") as log:
        proc = subprocess.Popen(pinned(SERVER_CORE, [str(BIN / "python"), str(ROOT / "bench" / "floor.py"), str(port)]),
                                stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}/mcp"
    wait_http(url, proc)
    return Server("floor", url, proc)


class ProcessCpu:
    """CPU seconds of groups of processes over time (the local PostgreSQL cluster's, which ours runs
    on and the peers do not; the load generator's; an upstream's), sampled in the background so the
    measured window can be cut out of setup and clean-up. Backends come and go: each process counts
    with the last CPU time it was seen with."""

    def __init__(self, groups: dict[str, Callable[[int, str], bool]], every_s: float = 0.25) -> None:
        import threading

        self._groups = groups
        self._last: dict[str, dict[int, float]] = {group: {} for group in groups}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            for proc in psutil.process_iter(["name", "cpu_times"]):
                if (times := proc.info["cpu_times"]) is None:
                    continue
                for group, chosen in self._groups.items():
                    if chosen(proc.pid, proc.info["name"]):
                        self._last[group][proc.pid] = times.user + times.system
            self.samples.append((time.time(), {group: sum(last.values()) for group, last in self._last.items()}))
            self._stop.wait(self._every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, group: str, t: float) -> float:
        """The group's cumulative CPU seconds at wall time t (the last sample before it)."""
        before = [cpu[group] for ts, cpu in self.samples if ts <= t]
        return before[-1] if before else (self.samples[0][1][group] if self.samples else 0.0)

    def ms_per_op(self, group: str, window: tuple[float, float], ops: int) -> float:
        return 1000 * (self.at(group, window[1]) - self.at(group, window[0])) / ops


def run_load(
    server: Server, workload: str, duration: float, out: Path, profile: Path | None = None, poll_ms: float = EXT_POLL_MS
) -> dict[str, Any]:
    cfg = WORKLOADS[workload]
    cmd = [str(BIN / "mcp-tasks"), "bench", "--url", server.url, "--workload", cfg.get("base", workload),
           "--clients", str(cfg["clients"]), "--duration", str(duration), "--server-pid", str(server.proc.pid),
           "--json", str(out), "--quiet"]  # fmt: skip
    if "held" in cfg:
        cmd += ["--held", str(cfg["held"])]
    if "tool" in cfg:
        cmd += ["--tool", cfg["tool"]]
    if workload == "ext-lifecycle":
        cmd += ["--task-seconds", str(EXT_TASK_SECONDS), "--poll-ms", str(poll_ms)]
    for token in server.tokens[: cfg.get("principals", len(server.tokens))]:
        cmd.append(f"--token={token}")
    pids: dict[str, int] = {"upstream": server.upstream.pid if server.upstream is not None else -1}
    cpu = ProcessCpu({
        "db": lambda _pid, name: server.name == "ours" and name == "postgres",
        "load": lambda pid, _name: pid == pids.get("load"),  # the load core's tenants: the generator,
        "upstream": lambda pid, _name: pid == pids["upstream"],  # and the hop's upstream
    })  # fmt: skip
    spy = None
    if profile is not None:  # sampling costs the server a little CPU: profile runs are not for the report
        profile.parent.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(pinned(LOAD_CORE, [str(BIN / "py-spy"), "record", "--pid", str(server.proc.pid), "--output", str(profile),
                                                  "--duration", str(int(duration) + 5), "--format", "raw", *(["--rate", "250"] if SPY_BLOCKING or SPY_NATIVE else ["--nonblocking"]),
                                                  *(["--native"] if SPY_NATIVE else [])]),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    load = subprocess.Popen(pinned(LOAD_CORE, cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids["load"] = load.pid
    try:
        _, stderr = load.communicate(timeout=duration * 10 + 600)
    except subprocess.TimeoutExpired:
        load.kill()
        raise
    finally:
        cpu.stop()
    if spy is not None:
        spy.send_signal(2)
        spy.wait(timeout=60)
    if not out.exists():
        # Its last words (a setup failure, say) are worth keeping: the report lists them.
        said = stderr.decode(errors="replace").strip().splitlines()
        return {"error": "the load generator produced no result" + (f": {said[-1][:300]}" if said else "")}
    result: dict[str, Any] = json.loads(out.read_text())
    if result.get("ops") and result.get("window_unix"):
        window, ops = tuple(result["window_unix"]), result["ops"]
        result["load_cpu_ms_per_op"] = cpu.ms_per_op("load", window, ops)
        if server.name == "ours":
            result["db_cpu_ms_per_op"] = cpu.ms_per_op("db", window, ops)
        if server.upstream is not None:
            result["upstream_cpu_ms_per_op"] = cpu.ms_per_op("upstream", window, ops)
    return result


# Ours on the extension: an optional tool becomes a task once it is still running after the grace
# (500 ms by default, else it answers within the call); with 0 every call that does not end in its
# first loop turn becomes a task at once, as the peer makes every declaring call a task.
EXT_ENV = {"MCP_TASKS_TASK_GRACE_MS": "0"}


@contextlib.contextmanager
def upstream_for(workload: str, logs: Path) -> Iterator[tuple[dict[str, str], subprocess.Popen[bytes] | None]]:
    """For a hop workload, the env naming the upstream MCP server (on the load core) and its
    process; for a traced one, the env that turns tracing on, to an OTLP sink on the load core."""
    if workload in TRACED:
        port = free_port()
        with (logs / "otlp-sink.log").open("ab") as log:
            sink = subprocess.Popen(pinned(LOAD_CORE, [str(BIN / "python"), "bench/otlp_sink.py", str(port)]),
                                    cwd=ROOT, stdout=log, stderr=log)  # fmt: skip
        try:
            yield {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, None
        finally:
            sink.terminate()
            sink.wait(timeout=15)
        return
    if workload not in HOP:
        yield {}, None
        return
    port = free_port()
    with (logs / "upstream.log").open("ab") as log:
        proc = subprocess.Popen(pinned(LOAD_CORE, [str(BIN / "python"), "-m", "tests.upstream_server", "http", str(port)]),
                                cwd=ROOT, stdout=log, stderr=log)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        wait_http(url, proc)
        file = logs / "upstreams.toml"
        file.write_text(f'[[upstream]]\nname = "up"\nurl = "{url}"\nmax_concurrency = 64\n')
        yield {"MCP_TASKS_UPSTREAMS_FILE": str(file)}, proc
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@contextlib.contextmanager
def started(name: str, dbs: Databases, logs: Path, workload: str = "") -> Iterator[Server]:
    with upstream_for(workload if name == "ours" else "", logs) as (upstream_env, upstream):
        server = (
            start_ours(
                dbs.fresh(),
                logs,
                {**(EXT_ENV if workload in EXT_WORKLOADS else {}), **upstream_env},
                WORKLOADS.get(workload, {}).get("principals", 32),
            )
            if name == "ours"
            else start_floor(logs)
            if name == "floor"
            else start_peer(name, logs)
        )
        server.upstream = upstream
        try:
            yield server
        finally:
            server.stop()


def ensure_peers(wanted: set[str]) -> list[str]:
    """Install the wanted peers outside the project tree (idempotent); return them in report order."""
    if not wanted:
        return []
    env = {**os.environ, "PEERS_SRC": str(SHARED / "peers")}
    if "fastmcp4" in wanted:  # fastmcp==4.1.4 + fastmcp-tasks==4.1.4 in $PEERS/venv-fastmcp4
        env["PEERS_FASTMCP4"] = "1"
    subprocess.run(["bash", str(ROOT / "scripts" / "install-peers.sh")], env=env, check=True, capture_output=True)
    venv = PEERS / "venv-fastmcp3"
    if "fastmcp" in wanted and not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "fastmcp[tasks]==3.4.11"], check=True, capture_output=True
        )
    return [name for name in (*LEGACY_PEERS, *EXT_PEERS) if name in wanted]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--out", default="/var/tmp/mcp-tasks-bench-results.json", help="raw results (JSON)")
    ap.add_argument("--smoke", action="store_true", help="one short round, ours and the floor only (CI)")
    ap.add_argument("--no-scale", action="store_true", help="skip the 1k/100k/1M stored-tasks scale run")
    ap.add_argument("--server-tree", metavar="DIR", help="run our server from this checkout (e.g. a worktree of "
                    "an earlier commit, sharing this venv): before/after in one run of this harness")  # fmt: skip
    ap.add_argument(
        "--spy-blocking", action="store_true", help="--profile pausing the server per sample (exact stacks)"
    )
    ap.add_argument(
        "--spy-native",
        action="store_true",
        help="--profile with native frames too (C extensions: asyncpg, json); py-spy takes those pausing the server, as --spy-blocking",
    )
    ap.add_argument("--servers", help="comma-separated subset of ours,sdk,fastmcp,fastmcp4,floor (default: all)")
    ap.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    ap.add_argument("--ext-poll-ms", type=float, default=EXT_POLL_MS, help="ext-lifecycle: tasks/get at once, "
                    "then every this many ms until completed (default %(default)s)")  # fmt: skip
    ap.add_argument("--profile", metavar="DIR", help="record py-spy folded stacks of our service per run")
    ap.add_argument("--doc", metavar="MD", help="write the report into this file's bench section (make bench: "
                    "docs/performance.md)")  # fmt: skip
    ap.add_argument("--render", metavar="JSON", help="only render a saved --out file (and write --doc)")
    args = ap.parse_args()
    global SERVER_TREE, SPY_BLOCKING, SPY_NATIVE
    SERVER_TREE = str(Path(args.server_tree).resolve()) if args.server_tree else None
    SPY_BLOCKING = args.spy_blocking
    SPY_NATIVE = args.spy_native
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(render(saved))
        if args.doc:
            write_doc(Path(args.doc), saved)
        return 1 if failures(saved) else 0
    only = set(args.servers.split(",")) if args.servers else None
    workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    if args.smoke and not args.workloads:  # seconds: one one-principal variant keeps that path working
        workloads = [w for w in workloads if w not in ONE_PRINCIPAL or w == "create-1p"]
    needed = {p for w in workloads for p in peers_of(w)} & (only if only is not None else set(PEER_SERVERS))
    peers = [] if args.smoke else ensure_peers(needed)
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
        for r, workload, name in schedule(workloads, peers, rounds, only):
            with started(name, dbs, logs, workload) as server:
                out = logs / f"{name}-{workload}-{r}.json"
                profile = Path(args.profile) / f"{workload}-{r}.folded" if args.profile and name == "ours" else None
                result = run_load(server, workload, duration, out, profile, args.ext_poll_ms)
            results.setdefault(workload, {}).setdefault(name, []).append(result)
            print(f"round {r + 1} {workload:13} {name:8} {summary(result)}", file=sys.stderr, flush=True)
        scale = {} if args.smoke or args.no_scale else scale_run(dbs, logs, duration, rounds)
    finally:
        if not args.smoke:
            pin_postgres("0-" + str((os.cpu_count() or 1) - 1))
        dbs.drop_all()
    report = {
        "results": results,
        "scale": scale,
        "rounds": rounds,
        "duration_s": duration,
        "ext_poll_ms": args.ext_poll_ms,
        "machine": machine(),
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(render(report))
    if args.doc:
        write_doc(Path(args.doc), report)
        print(f"results written to {args.doc}", file=sys.stderr)
    return 1 if failures(report) else 0


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


CPU_TARGET_MS = 0.35  # server CPU per plain request
P99_SPREAD_TARGET = 1.5  # tasks/get p99, largest over smallest, 1 thousand to 1 million stored
RSS_TARGET_KIB = 1024  # server RSS growth per 1,000 pending tasks


def schedule(workloads: list[str], peers: list[str], rounds: int, only: set[str] | None) -> list[tuple[int, str, str]]:
    """(round, workload, server) in the order they run: per round every workload with ours and its
    peers (who goes first alternates between rounds, the floor last on plain), and a one-principal
    variant right after ours' run of its spread load, so that the pair shares that minute's speed."""
    order: list[tuple[int, str, str]] = []
    for r in range(rounds):
        for workload in (w for w in workloads if WORKLOADS[w].get("base") not in workloads):
            servers = ["ours", *(p for p in peers if p in peers_of(workload))]
            servers = servers if r % 2 == 0 else list(reversed(servers))
            names = [*servers, "floor"] if workload == "plain" else servers
            for name in (n for n in names if only is None or n in only):
                order.append((r, workload, name))
                if name == "ours":
                    order += [(r, v, name) for v in workloads if WORKLOADS[v].get("base") == workload]
    return order


def one_principal_ratios(report: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """variant -> (its base workload, the median over rounds of one-principal throughput over the
    spread one's). Each round runs the variant right after ours' spread load, so a round's pair
    shares the machine's speed of that minute (it drifts by 20-30 % over minutes on a shared VM);
    a ratio of the two medians would pair runs from different rounds."""
    out: dict[str, tuple[str, float]] = {}
    results = report["results"]
    for variant, base in ONE_PRINCIPAL.items():
        one_runs = results.get(variant, {}).get("ours", [])
        spread_runs = results.get(base, {}).get("ours", [])
        pairs = [
            o.get("throughput_per_s", float("nan")) / s_["throughput_per_s"]
            for s_, o in zip(spread_runs, one_runs, strict=False)
            if s_.get("throughput_per_s")
        ]
        if pairs:
            out[variant] = (base, statistics.median(pairs))
    return out


def hop_figures(report: dict[str, Any]) -> dict[str, float]:
    """The upstream hop (issue 41): lifecycles and latency of ``lifecycle-up`` against ours' local
    ``lifecycle`` of the same rounds; the throughput ratio is the median of the rounds' ratios."""
    results = report["results"]
    up_runs = results.get("lifecycle-up", {}).get("ours", [])
    local_runs = results.get("lifecycle", {}).get("ours", [])
    if not up_runs:
        return {}
    nan = float("nan")

    def p(runs: list[dict[str, Any]], key: str) -> float:
        values = [(r.get("op_latency") or {}).get(key) for r in runs]
        return statistics.median([v for v in values if v is not None] or [nan])

    pairs = [u.get("throughput_per_s", nan) / loc["throughput_per_s"]
             for loc, u in zip(local_runs, up_runs, strict=False) if loc.get("throughput_per_s")]  # fmt: skip
    figures = {
        "local": median_of(local_runs, "throughput_per_s"), "upstream": median_of(up_runs, "throughput_per_s"),
        "ratio": statistics.median(pairs) if pairs else nan,
        "local_p50": p(local_runs, "p50_ms"), "upstream_p50": p(up_runs, "p50_ms"),
        "local_p99": p(local_runs, "p99_ms"), "upstream_p99": p(up_runs, "p99_ms"),
        "local_cpu": _cpu(local_runs), "upstream_cpu": _cpu(up_runs),
        "local_db_cpu": median_of(local_runs, "db_cpu_ms_per_op"), "upstream_db_cpu": median_of(up_runs, "db_cpu_ms_per_op"),
        "upstream_process_cpu": median_of(up_runs, "upstream_cpu_ms_per_op"),
        "local_load_cpu": median_of(local_runs, "load_cpu_ms_per_op"), "upstream_load_cpu": median_of(up_runs, "load_cpu_ms_per_op"),
    }  # fmt: skip
    figures["added_p50"] = figures["upstream_p50"] - figures["local_p50"]
    return figures


def traced_figures(report: dict[str, Any]) -> dict[str, float]:
    """Tracing's cost (issue 44): lifecycles of ``lifecycle-traced`` against ours' untraced
    ``lifecycle`` of the same rounds; the ratio is the median of the rounds' ratios."""
    results = report["results"]
    traced = results.get("lifecycle-traced", {}).get("ours", [])
    plain = results.get("lifecycle", {}).get("ours", [])
    if not traced:
        return {}
    pairs = [t.get("throughput_per_s", float("nan")) / p["throughput_per_s"]
             for p, t in zip(plain, traced, strict=False) if p.get("throughput_per_s")]  # fmt: skip
    return {"untraced": median_of(plain, "throughput_per_s"), "traced": median_of(traced, "throughput_per_s"),
            "ratio": statistics.median(pairs) if pairs else float("nan")}  # fmt: skip


def core_busy(runs: list[dict[str, Any]]) -> float:
    """Median share of the server core that was busy over the runs: our process's CPU seconds plus
    PostgreSQL's (pinned to the same core) over the measured seconds."""
    nan = float("nan")
    shares = [
        ((r.get("server") or {}).get("cpu_s", nan) + r.get("db_cpu_ms_per_op", 0.0) * r["ops"] / 1000) / r["duration_s"]
        for r in runs
        if r.get("ops") and r.get("duration_s")
    ]
    return statistics.median(shares) if shares else nan


def failures(report: dict[str, Any]) -> int:
    """Failed operations of our service over every run, the scale run included."""
    runs = [r for per in report["results"].values() for r in per.get("ours", [])]
    scale = (report.get("scale") or {}).values()
    return sum(r.get("errors", 1) for r in runs) + sum(int(v.get("errors", 1)) for v in scale)


def _cpu(runs: list[dict[str, Any]]) -> float:
    """Median server CPU per operation over the runs (NaN if not measured)."""
    nan = float("nan")
    return statistics.median([(r.get("server") or {}).get("cpu_ms_per_op", nan) for r in runs] or [nan])


def gets_per_lifecycle(runs: list[dict[str, Any]]) -> float:
    """Median over the runs of tasks/get requests per completed ext lifecycle (the polling it took)."""
    per = [r["methods"]["tasks/get"]["count"] / r["ops"] for r in runs
           if r.get("ops") and "tasks/get" in (r.get("methods") or {})]  # fmt: skip
    return statistics.median(per) if per else float("nan")


def _floor_ratio(per: dict[str, list[dict[str, Any]]]) -> float:
    """Our median throughput over the floor's of the same workload (NaN without a floor)."""
    ours, floor = (
        median_of(per.get("ours", []), "throughput_per_s"),
        median_of(per.get("floor", []), "throughput_per_s"),
    )
    return ours / floor if floor == floor and floor > 0 else float("nan")


def render(report: dict[str, Any]) -> str:
    """Medians, ratios to the best peer and the floor, and a verdict per target (markdown)."""
    nan = float("nan")
    results: dict[str, dict[str, list[dict[str, Any]]]] = report["results"]
    one = {w: per for w, per in results.items() if w in ONE_PRINCIPAL}
    hop = hop_figures(report)
    traced = traced_figures(report)
    results = {w: per for w, per in results.items() if w not in ONE_PRINCIPAL and w not in HOP and w not in TRACED}
    legacy = {w: per for w, per in results.items() if w not in EXT_WORKLOADS}
    ext = {w: per for w, per in results.items() if w in EXT_WORKLOADS}
    ratios: dict[str, float] = {}
    for workload, per in results.items():
        tput = {name: median_of(runs, "throughput_per_s") for name, runs in per.items()}
        peers = [v for k, v in tput.items() if k in peers_of(workload)]
        ratios[workload] = tput.get("ours", nan) / max(peers) if peers else nan
    lines = [
        "| workload | ours | official SDK | FastMCP | floor | ours / best peer | ours / floor | target |",
        "|---|---|---|---|---|---|---|---|",
    ] if legacy or not ext else []  # fmt: skip
    for workload, per in legacy.items():
        tput = {name: median_of(runs, "throughput_per_s") for name, runs in per.items()}
        floor = tput.get("ours", nan) / tput["floor"] if tput.get("floor") else nan
        cells = [_num(tput.get(k, nan)) for k in ("ours", "sdk", "fastmcp", "floor")]
        lines.append(
            f"| {workload} | {' | '.join(cells)} | {_num(ratios[workload], '.2f', 'x')} | {_num(floor, '.2f', 'x')} "
            f"| >= {TARGETS[workload]:.0f}x |"
        )
    if ext:
        lines += [""] if lines else []
        lines += ["2026-07-28 Tasks extension (`io.modelcontextprotocol/tasks`), against the fastmcp-tasks 4.1.4 peer:",
                  "", "| workload | ours | fastmcp-tasks | ours / peer | target |", "|---|---|---|---|---|"]  # fmt: skip
        for workload, per in ext.items():
            tput = {name: median_of(runs, "throughput_per_s") for name, runs in per.items()}
            cells = [_num(tput.get(k, nan)) for k in ("ours", "fastmcp4")]
            lines.append(f"| {workload} | {' | '.join(cells)} | {_num(ratios[workload], '.2f', 'x')} "
                         f"| >= {TARGETS[workload]:.0f}x |")  # fmt: skip
        if "ext-lifecycle" in ext:
            polls = ", ".join(f"{PEER_NAMES.get(name, name)} {_num(gets_per_lifecycle(runs), '.2f')}"
                              for name, runs in ext["ext-lifecycle"].items())  # fmt: skip
            lines += [
                "",
                f"`tasks/get` requests per ext lifecycle (at once, then every {report.get('ext_poll_ms', EXT_POLL_MS):g} ms; "
                f"medians): {polls}",
            ]
    lines += ["", "Per round, ours against the best peer of that round (ops/s):", ""]
    for workload, per in results.items():
        ours_runs = [r.get("throughput_per_s", nan) for r in per.get("ours", [])]
        best = [
            max(vals)
            for vals in zip(
                *([r.get("throughput_per_s", nan) for r in per[k]] for k in peers_of(workload) if k in per),
                strict=False,
            )
        ]
        pairs = ", ".join(f"{_num(o)} / {_num(b)}" for o, b in zip(ours_runs, best, strict=False)) or ", ".join(
            _num(o) for o in ours_runs
        )
        lines.append(f"- {workload}: {pairs}")
    lines += ["", "Server CPU per operation, ms (ours: Python + PostgreSQL):"]
    if legacy or not ext:
        lines += ["", "| workload | ours | official SDK | FastMCP | floor |", "|---|---|---|---|---|"]
    cpu_ours: dict[str, float] = {}
    ext_cpu_lines: list[str] = []
    for workload, per in results.items():
        cpu = {name: _cpu(runs) for name, runs in per.items()}
        db = median_of(per.get("ours", []), "db_cpu_ms_per_op")
        cpu_ours[workload] = cpu.get("ours", nan) + (db if db == db else 0.0)
        ours = f"{_num(cpu.get('ours', nan), '.3f')} + {_num(db, '.3f')}"
        if workload in EXT_WORKLOADS:
            ext_cpu_lines.append(f"| {workload} | {ours} | {_num(cpu.get('fastmcp4', nan), '.3f')} |")
            continue
        rest = [_num(cpu.get(k, nan), ".3f") for k in ("sdk", "fastmcp", "floor")]
        lines.append(f"| {workload} | {ours} | {' | '.join(rest)} |")
    if ext_cpu_lines:
        lines += ["", "| extension workload | ours | fastmcp-tasks |", "|---|---|---|", *ext_cpu_lines]
    one_ratios = one_principal_ratios(report)
    if one_ratios:
        lines += ["", "One principal (every client on one token: one tenant, one subject) against the spread load "
                  "(32 principals, 8 tenants x 4 subjects) of the same run, ours only:", "",
                  "| workload | spread | one principal | one / spread | per round | CPU per op, ms (spread / one) "
                  "| server core busy (spread / one) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        busy: list[float] = []
        for variant, (base, ratio) in one_ratios.items():
            spread_runs = results.get(base, {}).get("ours", [])
            one_runs = one[variant].get("ours", [])
            per_round = ", ".join(
                _num(o.get("throughput_per_s", nan) / s_.get("throughput_per_s", nan), ".2f")
                if s_.get("throughput_per_s") else "-"
                for s_, o in zip(spread_runs, one_runs, strict=False)
            )  # fmt: skip
            cpu_s = _cpu(spread_runs) + median_of(spread_runs, "db_cpu_ms_per_op")
            cpu_o = _cpu(one_runs) + median_of(one_runs, "db_cpu_ms_per_op")
            busy += [core_busy(spread_runs), core_busy(one_runs)]
            lines.append(
                f"| {base} | {_num(median_of(spread_runs, 'throughput_per_s'))} "
                f"| {_num(median_of(one_runs, 'throughput_per_s'))} | {_num(ratio, '.2f', 'x')} | {per_round} "
                f"| {_num(cpu_s, '.3f')} / {_num(cpu_o, '.3f')} | {_num(100 * busy[-2], '.0f', ' %')} / {_num(100 * busy[-1], '.0f', ' %')} |"
            )
    if hop:
        lines += ["", "The upstream hop: the lifecycle load on `up.echo` of an upstream MCP server behind ours (the "
                  "official SDK's FastMCP, on the load core) against ours' own `echo`, the same round, ours only:", "",
                  "| | local `echo` | upstream `up.echo` | upstream / local |", "|---|---|---|---|",
                  f"| lifecycles/s | {_num(hop['local'])} | {_num(hop['upstream'])} | {_num(hop['ratio'], '.2f', 'x')} |",
                  f"| p50, ms | {_num(hop['local_p50'], '.1f')} | {_num(hop['upstream_p50'], '.1f')} "
                  f"| +{_num(hop['added_p50'], '.1f')} |",
                  f"| p99, ms | {_num(hop['local_p99'], '.1f')} | {_num(hop['upstream_p99'], '.1f')} | |",
                  f"| CPU per lifecycle, ms: ours + PostgreSQL (server core) | {_num(hop['local_cpu'], '.2f')} + "
                  f"{_num(hop['local_db_cpu'], '.2f')} | {_num(hop['upstream_cpu'], '.2f')} + {_num(hop['upstream_db_cpu'], '.2f')} | |",
                  f"| CPU per lifecycle, ms: the load generator + the upstream's process (load core) | "
                  f"{_num(hop['local_load_cpu'], '.2f')} | {_num(hop['upstream_load_cpu'], '.2f')} + "
                  f"{_num(hop['upstream_process_cpu'], '.2f')} | |"]  # fmt: skip
    if traced:
        lines += ["", "Tracing on (OTLP/HTTP to a sink on the load core, the default sampler: parent-based 10 %) "
                  f"against off, the lifecycle load of the same rounds, ours only: {_num(traced['traced'])} against "
                  f"{_num(traced['untraced'])} lifecycles/s, {_num(traced['ratio'], '.2f', 'x')} (median of the "
                  "rounds' ratios)."]  # fmt: skip
    scale: dict[str, dict[str, float]] = report.get("scale") or {}
    if scale:
        lines += ["", "tasks/get with 6,400 held and other tenants' tasks stored (median p99 of the runs): " + ", ".join(
            f"{_num(v['p99_ms'], '.1f')} ms with {stored}" for stored, v in scale.items())]  # fmt: skip
    rss = [
        (r.get("server") or {}).get("rss_growth_kib_per_1000_pending", nan)
        for r in results.get("create", {}).get("ours", [])
    ]
    notes: list[str] = []
    failed = failures(report)
    for name in (*LEGACY_PEERS, *EXT_PEERS, "floor"):  # the peers' failures are facts about them, not targets of ours
        for workload, per in results.items():
            kinds: dict[str, int] = {}
            for r in per.get(name, []):
                for kind, n in (r.get("error_kinds") or ({r["error"]: 1} if "error" in r else {})).items():
                    kinds[kind] = kinds.get(kind, 0) + n
            if any(kinds.values()):
                shown = ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)
                notes.append(f"{name} {workload}: {shown} failed operations over {len(per[name])} runs.")
    p99s = [v["p99_ms"] for v in scale.values()]
    spread = max(p99s) / min(p99s) if p99s and min(p99s) > 0 else nan
    plain_floor = _floor_ratio(results.get("plain", {}))
    verdicts = [
        ("plain `tools/call` >= 5x best peer", ratios.get("plain", nan), f"{_num(ratios.get('plain', nan), '.2f', 'x')}", TARGETS["plain"], True),
        (f"plain `tools/call` >= {FLOOR_TARGET}x the bare Starlette floor", plain_floor, f"{_num(plain_floor, '.2f', 'x')}", FLOOR_TARGET, True),
        ("... with <= 0.35 ms server CPU per request", cpu_ours.get("plain", nan), f"{_num(cpu_ours.get('plain', nan), '.3f', ' ms')}", CPU_TARGET_MS, False),
        (f"`tasks/get` >= {TARGETS['get']:.0f}x best peer, 6,400 held", ratios.get("get", nan), f"{_num(ratios.get('get', nan), '.2f', 'x')}", TARGETS["get"], True),
        ("`tasks/get` p99 within 1.5x from 1 thousand to 1 million stored", spread, f"{_num(spread, '.2f', 'x')}", P99_SPREAD_TARGET, False),
        (f"task lifecycles/s >= {TARGETS['lifecycle']:.0f}x best peer", ratios.get("lifecycle", nan), f"{_num(ratios.get('lifecycle', nan), '.2f', 'x')}", TARGETS["lifecycle"], True),
        (f"task creates/s >= {TARGETS['create']:.0f}x best peer", ratios.get("create", nan), f"{_num(ratios.get('create', nan), '.2f', 'x')}", TARGETS["create"], True),
        ("RSS growth <= 1 MiB per 1,000 pending tasks", max(rss, default=nan), f"{_num(max(rss, default=nan), '.0f', ' KiB')} (worst round)", RSS_TARGET_KIB, False),
        ("extension task lifecycles/s >= 5x fastmcp-tasks", ratios.get("ext-lifecycle", nan), f"{_num(ratios.get('ext-lifecycle', nan), '.2f', 'x')}", TARGETS["ext-lifecycle"], True),
        ("extension `tasks/get` >= 10x fastmcp-tasks, 6,400 held", ratios.get("ext-get", nan), f"{_num(ratios.get('ext-get', nan), '.2f', 'x')}", TARGETS["ext-get"], True),
        ("zero failed operations (ours, every run)", float(failed), str(failed), 0.0, False),
    ]  # fmt: skip
    if one_ratios:
        worst = min(r for _b, r in one_ratios.values())
        names = ", ".join(b for b, _r in one_ratios.values())
        verdicts.insert(-1, (f"one principal >= {ONE_PRINCIPAL_TARGET}x the spread load ({names}; worst)", worst,
                             _num(worst, ".2f", "x"), ONE_PRINCIPAL_TARGET, True))  # fmt: skip
        idle = min((b for b in busy if b == b), default=nan)  # NaN: not measured
        verdicts.insert(-1, (f"... with the server core >= {100 * BUSY_TARGET:.0f} % busy in both (least busy median)", idle,
                             _num(100 * idle, ".0f", " %"), BUSY_TARGET, True))  # fmt: skip
    if hop:
        verdicts.insert(-1, (f"upstream lifecycles/s >= {HOP_TARGET}x local (median of the rounds' ratios)", hop["ratio"],
                             _num(hop["ratio"], ".2f", "x"), HOP_TARGET, True))  # fmt: skip
        verdicts.insert(-1, (f"... adding <= {HOP_P50_TARGET_MS:g} ms p50", hop["added_p50"],
                             _num(hop["added_p50"], ".1f", " ms"), HOP_P50_TARGET_MS, False))  # fmt: skip
    if traced:
        verdicts.insert(-1, (f"lifecycles/s with tracing on >= {TRACED_TARGET}x off (median of the rounds' ratios)",
                             traced["ratio"], _num(traced["ratio"], ".2f", "x"), TRACED_TARGET, True))  # fmt: skip
    lines += ["", "| target | result | verdict |", "|---|---|---|"]
    for name, got, shown, target, at_least in verdicts:
        verdict = "-" if got != got else ("met" if (got >= target if at_least else got <= target) else "**missed**")
        lines.append(f"| {name} | {shown} | {verdict} |")
    if notes:
        lines += ["", "Peers' failed operations (not ours; each counted, none dropped):", ""]
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def write_doc(doc: Path, report: dict[str, Any]) -> None:
    """Replace the generated section of ``doc`` (between the bench markers) with this run's report."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section to write the results into")
    head, rest = text.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    body = (f"\n_Written by `make bench` on {stamp}: {report['rounds']} rounds of {report['duration_s']:.0f} s, "
            f"medians, on {machine_text(report)}._\n\n{render(report)}\n")  # fmt: skip
    doc.write_text(head + BEGIN + body + END + tail)


def scale_run(dbs: Databases, logs: Path, duration: float, rounds: int) -> dict[str, dict[str, Any]]:
    """tasks/get p99 (median over ``rounds`` runs, each on a freshly filled database) and failed
    operations, with 1 thousand, 100 thousand and 1 million other tasks stored."""
    out: dict[str, dict[str, Any]] = {}
    for stored in (1_000, 100_000, 1_000_000):
        p99s: list[float] = []
        errors = 0
        for r in range(rounds):
            db_url = dbs.fresh()
            asyncio.run(fill(db_url, stored))
            with started_ours_on(db_url, logs) as server:
                result = run_load(server, "get", duration, logs / f"scale-{stored}-{r}.json")
            p99s.append(result.get("methods", {}).get("tasks/get", {}).get("p99_ms", float("nan")))
            errors += result.get("errors", 1)
            print(
                f"scale {stored:>9,} stored, run {r + 1}: tasks/get p99 {p99s[-1]:.2f} ms  errors={result.get('errors', 1)}",
                file=sys.stderr,
                flush=True,
            )
        out[f"{stored:,}"] = {"p99_ms": statistics.median(p99s), "p99_runs": p99s, "errors": errors}
    return out


@contextlib.contextmanager
def started_ours_on(db_url: str, logs: Path) -> Iterator[Server]:
    server = start_ours(db_url, logs)
    try:
        yield server
    finally:
        server.stop()


async def fill(db_url: str, n: int) -> None:
    """Completed tasks of other tenants (RLS keeps them out of every query but the indexes), each
    with its finish time as the service records it."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(
            """
            INSERT INTO tasks (tenant_id, task_id, subject, wire, tool, arguments, status, outcome, payload,
                               ttl_ms, poll_interval_ms, expires_at, created_at, last_updated_at, finished_at)
            SELECT 'filler-' || (i % 1000), md5(i::text) || md5((i + 1)::text), 'user-' || (i % 50), '2025-11-25',
                   'echo', '{"text":"x"}', 'completed', 'result', '{"content":[{"type":"text","text":"x"}]}',
                   86400000, 1000, now() + interval '1 day', now() - (i || ' ms')::interval, now(), now()
            FROM generate_series(1, $1) AS i
            """,
            n,
        )
        # A steady state, as a database that grew over months is in: no autovacuum of the bulk load
        # and no checkpoint of its WAL running on the server's core while we measure.
        await conn.execute("VACUUM (ANALYZE) tasks")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.exit(main())
