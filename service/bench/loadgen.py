"""The load generator behind ``mcp-tasks bench``: many MCP clients driving one workload at any endpoint
(2025-11-25 sessions, or 2026-07-28 Tasks extension clients for the ``ext-*`` workloads)."""

from __future__ import annotations

import argparse
import asyncio
import random
import ssl
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, Final

import orjson

from service.bench.config import WORKLOADS, BenchConfig, BenchError, BenchUsageError, validate
from service.bench.probe import ProbeError, ServerProbe, ServerWindow
from service.bench.report import ProgressLine, advice, summary
from service.bench.stats import Recorder, latency_summary
from service.bench.v2026 import V2026Session
from service.bench.wire import McpSession, RequestFailed, Session
from service.bench.workloads import EXT_WORKLOADS, Client, Workload, cancel_held, run_op

__all__ = ["BenchConfig", "BenchError", "BenchUsageError", "main", "run_bench"]

TICK_S: Final = 0.5
CLEANUP_BUDGET_S: Final = 30.0


@dataclass
class _Phase:
    """Shared by all workers and the progress ticker; one event loop, so plain fields need no lock."""

    max_ops: int | None
    began: float  # perf_counter at the warm-up's start
    measuring: bool = False
    stopped: bool = False
    started: int = 0
    measuring_since: float = 0.0  # perf_counter at the measured phase's start
    window: ServerWindow | None = None  # the server's side of the measured phase, when probed


async def _open_sessions(clients: list[Client]) -> None:
    outcomes = await asyncio.gather(*(c.session.initialize() for c in clients), return_exceptions=True)
    kinds = Counter(o.kind if isinstance(o, RequestFailed) else type(o).__name__ for o in outcomes if o is not None)
    if kinds:
        listed = ", ".join(f"{k}={n}" for k, n in sorted(kinds.items()))
        fixes = " ".join(advice(dict(kinds), len(clients)))
        raise BenchError(
            f"{kinds.total()} of {len(clients)} sessions failed to initialize ({listed}){'; ' + fixes if fixes else ''}"
        )


async def _hold_tasks(config: BenchConfig, workload: Workload, clients: list[Client], progress: ProgressLine) -> None:
    rec = Recorder()
    started = perf_counter()

    def tick() -> None:
        if rec.ops % 100 == 0:
            progress.show("setup", perf_counter() - started, rec.ops, rec.failed_ops)

    await asyncio.gather(*(workload.hold(c, config.held, rec, tick) for c in clients))
    if rec.failed_ops:
        listed = ", ".join(f"{k}={n}" for k, n in sorted(rec.kinds.items()))
        fixes = " ".join(advice(dict(rec.kinds), rec.ops))
        raise BenchError(f"{rec.failed_ops} of {rec.ops} held tasks could not be created ({listed}); {fixes}")


async def _drive(
    op: Callable[[Client, Recorder], Awaitable[bool]], client: Client, phase: _Phase, warm: Recorder, measured: Recorder
) -> None:
    """One client's loop: warm-up operations, then measured ones until the phase stops (or max_ops)."""
    while not phase.stopped:
        if not phase.measuring:
            await run_op(op, client, warm)
            continue
        if phase.max_ops is not None:
            if phase.started >= phase.max_ops:
                return
            phase.started += 1
        await run_op(op, client, measured)


async def _tick(phase: _Phase, progress: ProgressLine, warm: Recorder, measured: Recorder) -> None:
    """Every TICK_S: the progress line, and a sample of the server while measuring."""
    while True:
        await asyncio.sleep(TICK_S)
        if phase.measuring:
            if phase.window is not None:
                phase.window.sample()
            progress.show("measuring", perf_counter() - phase.measuring_since, measured.ops, measured.failed_ops)
        else:
            progress.show("warm-up", perf_counter() - phase.began, warm.ops, warm.failed_ops)


async def _measure(
    config: BenchConfig, workload: Workload, clients: list[Client], probe: ServerProbe | None, progress: ProgressLine
) -> dict[str, Any]:
    warm, measured = Recorder(), Recorder()
    op = workload.operation()
    phase = _Phase(config.max_ops, began=perf_counter())
    progress.reset_rate()
    workers = [asyncio.create_task(_drive(op, c, phase, warm, measured)) for c in clients]
    ticking = asyncio.create_task(_tick(phase, progress, warm, measured))
    try:
        if config.warmup_s > 0:
            await asyncio.wait(workers, timeout=config.warmup_s)
        phase.window = ServerWindow(probe) if probe is not None else None
        phase.measuring = True
        phase.measuring_since = perf_counter()
        window_unix = [time.time(), 0.0]
        progress.reset_rate()
        await asyncio.wait(workers, timeout=config.duration_s)
        # Operations in flight finish and count: they started inside the measured phase.
        phase.stopped = True
        await asyncio.gather(*workers)
        duration = perf_counter() - phase.measuring_since
        window_unix[1] = time.time()
        if phase.window is not None:
            phase.window.finish()
    finally:
        for task in (*workers, ticking):
            task.cancel()
        await asyncio.gather(*workers, ticking, return_exceptions=True)
    progress.show("done", duration, measured.ops, measured.failed_ops, rate=measured.ops / max(duration, 1e-9))
    return _result(config, warm, measured, phase.window, duration, window_unix)


def _result(
    config: BenchConfig,
    warm: Recorder,
    measured: Recorder,
    window: ServerWindow | None,
    duration: float,
    window_unix: list[float],
) -> dict[str, Any]:
    """The run's report: what was measured, and the server's side of it when probed."""
    pending = measured.successes("tools/call") if config.workload == "create" else None
    # The headline counts successful operations only (issue 15): refusals are cheap and fast, and a
    # run that was mostly 429s must not read as a fast server.
    succeeded = measured.ops - measured.failed_ops
    kinds = dict(sorted(measured.kinds.items()))
    return {
        "workload": config.workload,
        "wire": "2026-07-28" if config.workload in EXT_WORKLOADS else "2025-11-25",
        "url": config.url,
        "clients": config.clients,
        "duration_s": round(duration, 3),
        "ops": succeeded,
        "attempted": measured.ops,
        "errors": measured.failed_ops,
        "error_share": round(measured.failed_ops / measured.ops, 4) if measured.ops else 0.0,
        "error_kinds": kinds,
        "advice": advice(kinds, measured.ops),
        "throughput_per_s": round(succeeded / duration, 1) if duration > 0 else 0.0,
        "attempted_per_s": round(measured.ops / duration, 1) if duration > 0 else 0.0,
        "methods": measured.methods(),
        "op_latency": latency_summary(measured.op_samples),
        "server": window.summary(succeeded, pending) if window is not None else None,
        "warmup": {"ops": warm.ops, "errors": warm.failed_ops},
        # Wall-clock bounds of the measured phase, to attribute other processes' CPU (e.g. a database).
        "window_unix": [round(t, 3) for t in window_unix],
    }


async def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run one workload and return the result; raises BenchUsageError (bad config) or BenchError (setup)."""
    validate(config)
    try:
        probe = ServerProbe(config.server_pid) if config.server_pid is not None else None
    except ProbeError as exc:
        raise BenchUsageError(str(exc)) from None
    workload = Workload.build(
        config.workload,
        config.tool,
        config.hold_tool,
        config.ttl_ms,
        task_seconds=config.task_seconds,
        poll_ms=config.poll_ms,
    )
    progress = ProgressLine(config.workload, config.progress)
    tokens = list(config.tokens)
    # One TLS context for every client (https only): building one per client is slow.
    ssl_context = ssl.create_default_context() if config.url.startswith("https:") else None
    clients: list[Client] = []
    for i in range(config.clients):
        token = tokens[i % len(tokens)] if tokens else None
        session: Session = (
            V2026Session(config.url, token=token, ssl_context=ssl_context)
            if config.workload in EXT_WORKLOADS
            else McpSession(config.url, token=token, ssl_context=ssl_context)
        )
        clients.append(Client(session, random.Random(i)))
    try:
        await _open_sessions(clients)
        if config.workload in ("get", "ext-get"):
            await _hold_tasks(config, workload, clients, progress)
        result = await _measure(config, workload, clients, probe, progress)
    finally:
        progress.close()
        # Not measured: leave the server as unloaded as we found it, within a bounded time.
        cleanup = await cancel_held(clients, CLEANUP_BUDGET_S)
        # Every session closes its own connection, whether or not its DELETE got through.
        await asyncio.gather(*(c.session.close() for c in clients))
    result["cleanup"] = cleanup.as_dict()
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcp-tasks bench", description="Load an MCP Tasks endpoint (ours or another).")
    p.add_argument("--url", default="http://127.0.0.1:8000/mcp", help="MCP endpoint (default %(default)s)")
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--clients", type=int, default=32, help="concurrent sessions (default %(default)s)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds (default %(default)s)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first (default %(default)s)")
    p.add_argument("--max-ops", type=int, default=None, help="stop after this many measured operations")
    p.add_argument("--held", type=int, default=200, help="tasks held per client for get, ext-get (default %(default)s)")
    p.add_argument("--token", action="append", default=[], help="bearer token; repeat for round-robin principals")
    p.add_argument("--tool", default="echo", help="tool for plain/lifecycle, args {text: x}")
    p.add_argument(
        "--hold-tool",
        default="sleep",
        help="tool for get/create/ext-get, args {seconds: 3600}; "
        "for ext-lifecycle {seconds: --task-seconds}, its result text must be 'slept <seconds>s'",
    )
    p.add_argument(
        "--task-seconds",
        type=float,
        default=0.005,
        help="ext-lifecycle: the hold tool's seconds (default %(default)s: a task that ends almost at once)",
    )
    p.add_argument(
        "--poll-ms",
        type=float,
        default=5.0,
        help="ext-lifecycle: tasks/get at once, then every "
        "this many ms until completed (default %(default)s; the servers' pollIntervalMs is ignored)",
    )
    p.add_argument("--ttl-ms", type=int, default=3_600_000, help="params.task.ttl (default %(default)s)")
    p.add_argument("--server-pid", type=int, default=None, help="measure this process tree's CPU and RSS")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the result here")
    p.add_argument("--quiet", action="store_true", help="no progress line and no summary")
    return p


def main(argv: list[str]) -> int:
    """``mcp-tasks bench``: 0 = no failed operation, 1 = some failed (or setup failed), 2 = bad usage."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad usage; the caller wants a status
        return exc.code if isinstance(exc.code, int) else 2
    config = BenchConfig(
        url=args.url,
        workload=args.workload,
        clients=args.clients,
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_ops=args.max_ops,
        held=args.held,
        tokens=tuple(args.token),
        tool=args.tool,
        hold_tool=args.hold_tool,
        ttl_ms=args.ttl_ms,
        task_seconds=args.task_seconds,
        poll_ms=args.poll_ms,
        server_pid=args.server_pid,
        allow_remote=args.allow_remote,
        progress=not args.quiet,
    )
    try:
        result = asyncio.run(run_bench(config))
    except BenchUsageError as exc:
        print(f"mcp-tasks bench: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"mcp-tasks bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    encoded = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    if args.json is not None:
        try:
            args.json.write_bytes(encoded + b"\n")
        except OSError as exc:
            print(f"mcp-tasks bench: cannot write {args.json}: {exc.strerror}", file=sys.stderr)
    if not args.quiet:
        print(summary(result), file=sys.stderr)
    sys.stdout.write(encoded.decode() + "\n")
    sys.stdout.flush()
    return 1 if result["errors"] else 0
