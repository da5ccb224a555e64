"""make soak (issue 13, point 7): mixed load on one `mcp-tasks serve` (hosted mode, as in make bench)
for a long time, sampling the server's RSS, open file descriptors and per-operation p99 every window.

Every window (30 s) runs, at once and through the bench's load generator (service/bench):
plain tools/call, the 2025-11-25 task lifecycle (create, get, result), tasks/get of held tasks
(created, then cancelled at the end of the window), and the 2026-07-28 extension's lifecycle. Fails
(exit 1) if any operation errs, or if RSS, fds or p99 keep growing: the last third of the windows
against the first third after a warm-up.

    python bench/soak.py [--seconds 900] [--window 30] [--json /var/tmp/mcp-tasks-soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import EXT_ENV, Databases, start_ours  # noqa: E402
from service.bench.config import BenchConfig  # noqa: E402
from service.bench.loadgen import run_bench  # noqa: E402

# workload -> clients; "get" holds tasks per client and cancels them when its window ends.
MIX: dict[str, dict[str, Any]] = {
    "plain": {"clients": 4},
    "lifecycle": {"clients": 4},
    "get": {"clients": 2, "held": 20},
    "ext-lifecycle": {"clients": 4},
}
# As make bench runs ours for the extension's lifecycle (a call becomes a task at once), and with
# slots for the held tasks besides the others (the default 32 would queue the lifecycle behind them).
SERVER_ENV = {**EXT_ENV, "MCP_TASKS_RUNNER_CONCURRENCY": "256"}
WARMUP_WINDOWS = 2
RSS_SLACK = (1.10, 8 * 2**20)  # the late median may exceed the early one by 10 % + 8 MiB
FDS_SLACK = 10
P99_SLACK = 3.0


async def window(url: str, tokens: list[str], seconds: float) -> dict[str, dict[str, Any]]:
    runs = {
        name: run_bench(
            BenchConfig(
                url=url, workload=name, clients=shape["clients"], held=shape.get("held", 200),  # type: ignore[arg-type]
                duration_s=seconds, warmup_s=0, tokens=tokens, progress=False,
            )
        )
        for name, shape in MIX.items()
    }  # fmt: skip
    results = await asyncio.gather(*runs.values(), return_exceptions=True)
    out: dict[str, dict[str, Any]] = {}
    for name, result in zip(runs, results, strict=True):
        if isinstance(result, BaseException):
            out[name] = {"errors": 1, "error_kinds": {type(result).__name__: 1}, "ops": 0, "op_latency": {}}
        else:
            out[name] = result
    return out


def sample(proc: psutil.Process) -> tuple[int, int]:
    return proc.memory_info().rss, proc.num_fds()


def judge(samples: list[dict[str, Any]]) -> list[str]:
    """What kept growing, or erred: the last third of the windows against the first third after warm-up."""
    problems = [f"window {s['t_s']} s: {s['errors']} errors {s['error_kinds']}" for s in samples if s["errors"]]
    steady = samples[WARMUP_WINDOWS:] if len(samples) > WARMUP_WINDOWS + 2 else samples
    third = max(1, len(steady) // 3)
    early, late = steady[:third], steady[-third:]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    if med(late, "rss") > med(early, "rss") * RSS_SLACK[0] + RSS_SLACK[1]:
        problems.append(f"RSS grew: {med(early, 'rss') / 2**20:.1f} -> {med(late, 'rss') / 2**20:.1f} MiB")
    if med(late, "fds") > med(early, "fds") + FDS_SLACK:
        problems.append(f"open fds grew: {med(early, 'fds'):.0f} -> {med(late, 'fds'):.0f}")
    for name in MIX:
        e = [r["p99_ms"][name] for r in early if r["p99_ms"].get(name) is not None]
        lt = [r["p99_ms"][name] for r in late if r["p99_ms"].get(name) is not None]
        if e and lt and statistics.median(lt) > statistics.median(e) * P99_SLACK:
            problems.append(f"{name} p99 grew: {statistics.median(e):.1f} -> {statistics.median(lt):.1f} ms")
    return problems


def table(samples: list[dict[str, Any]]) -> str:
    head = "| t (s) | RSS (MiB) | fds | ops | errors | " + " | ".join(f"p99 {n} (ms)" for n in MIX) + " |"
    rows = [head, "|" + "---|" * (5 + len(MIX))]
    for s in samples:
        p99 = " | ".join(f"{s['p99_ms'].get(n) or 0:.1f}" for n in MIX)
        rows.append(f"| {s['t_s']} | {s['rss'] / 2**20:.1f} | {s['fds']} | {s['ops']} | {s['errors']} | {p99} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--seconds", type=float, default=900.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--json", type=Path, default=Path("/var/tmp/mcp-tasks-soak.json"))
    args = p.parse_args()
    n_windows = max(1, round(args.seconds / args.window))
    dbs = Databases()
    logs = Path(tempfile.mkdtemp(prefix="mcp-tasks-soak-", dir="/var/tmp"))
    samples: list[dict[str, Any]] = []
    try:
        dbs.create_template()
        server = start_ours(dbs.fresh(), logs, SERVER_ENV)
        try:
            proc = psutil.Process(server.proc.pid)
            rss, fds = sample(proc)
            print(f"SOAK start: {n_windows} windows of {args.window:.0f} s; rss={rss / 2**20:.1f}MiB fds={fds}",
                  flush=True)  # fmt: skip
            began = time.monotonic()
            for _ in range(n_windows):
                results = asyncio.run(window(server.url, server.tokens, args.window))
                rss, fds = sample(proc)
                row = {
                    "t_s": round(time.monotonic() - began),
                    "rss": rss,
                    "fds": fds,
                    "ops": sum(r["ops"] for r in results.values()),
                    "errors": sum(r["errors"] + r.get("cleanup", {}).get("failed", 0) for r in results.values()),
                    "error_kinds": {n: r["error_kinds"] for n, r in results.items() if r["error_kinds"]},
                    "p99_ms": {n: r["op_latency"].get("p99_ms") for n, r in results.items()},
                }
                samples.append(row)
                p99 = " ".join(f"{n}={v or 0:.1f}" for n, v in row["p99_ms"].items())
                print(f"SOAK t={row['t_s']}s rss={rss / 2**20:.1f}MiB fds={fds} ops={row['ops']} "
                      f"errors={row['errors']} p99_ms {p99}", flush=True)  # fmt: skip
        finally:
            server.stop()
    finally:
        dbs.drop_all()
    problems = judge(samples)
    args.json.write_text(json.dumps({"window_s": args.window, "samples": samples, "problems": problems}, indent=2))
    print(table(samples))
    for problem in problems:
        print(f"SOAK FAILED: {problem}")
    print(f"SOAK {'failed' if problems else 'passed'}: {len(samples)} windows, "
          f"{sum(s['ops'] for s in samples)} operations, {sum(s['errors'] for s in samples)} errors")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
