"""Where PostgreSQL's CPU goes under one of our workloads: perf samples of the database's processes.

bench/sql_ab.py says how much a SQL variant saves; this says where the time goes before one is
written. Our server (hosted mode, its own fresh database, pinned with PostgreSQL to core 0 as in
`make bench`) is warmed up, then `perf record -e cpu-clock --call-graph dwarf` samples core 0 while
the load runs. The Debian build of PostgreSQL is stripped, but the executable exports most of its
functions for extensions (`nm -D`), so perf names them; its static functions and PL/pgSQL's
internals stay unnamed, and a call chain through one of those may stop there (the shares below are
then lower bounds). Each line is the share of PostgreSQL's samples spent in the function and
everything it called (inclusive).

    .venv/bin/python bench/pg_profile.py --workload lifecycle --seconds 5
    .venv/bin/python bench/pg_profile.py --workload create --tree /tmp/before   # an earlier tree

Needs `perf` (linux-perf) and root, or a kernel.perf_event_paranoid that lets you sample a CPU.
Nothing here is a verdict: `make bench` gives those.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # bench/run.py: the same servers, databases, pinning and load generator

# What each named function stands for in our statements (inclusive shares).
WATCHED: tuple[tuple[str, str], ...] = (
    ("plpgsql_call_handler", "PL/pgSQL functions (the batch functions and all they run)"),
    ("fmgr_security_definer", "SECURITY DEFINER functions (finish batch, audit appends), whole bodies"),
    ("standard_ExecutorStart", "executor start-up, once per statement"),
    ("ExecConstraints", "CHECK constraints: read from text and planned again for every statement"),
    ("GetCachedPlan", "plan cache lookups, custom plans included"),
    ("standard_planner", "planning"),
    ("AfterTriggerEndQuery", "statement triggers (the active-task counters)"),
    ("ExecInsertIndexTuples", "index entries of inserted and non-HOT updated rows"),
    ("heap_insert", "new rows"),
    ("heap_update", "row updates"),
    ("XLogInsert", "WAL records"),
    ("jsonb_build_object", "jsonb objects (the audit event's canonical text, until migration 0020)"),
    ("json_build_object", "json objects (NOTIFY payloads)"),
    ("pg_parse_json", "JSON input (the batches' items)"),
    ("pg_proc_aclcheck", "EXECUTE permission checks, once per function call site and statement"),
    ("CommitTransaction", "commits"),
    ("do_fsync", "WAL flushes (kernel)"),
)
LINE = re.compile(r"^\s*([\d.]+)%\s+([\d.]+)%\s+\[[.k]\]\s+(\S+)")
COMM = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s*$")


def report(data: Path, *args: str) -> str:
    return subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", *args], capture_output=True, text=True, check=True
    ).stdout


def summarise(data: Path, top: int) -> str:
    shares = {m.group(2): float(m.group(1)) for line in report(data, "--no-children", "-g", "none", "--sort", "comm").splitlines()
              if (m := COMM.match(line))}  # fmt: skip
    pg = shares.get("postgres", 0.0)
    if pg <= 0:
        return "no PostgreSQL samples (was the load running on core 0?)"
    children: dict[str, float] = {}
    selfs: list[tuple[float, str]] = []
    for line in report(data, "--comm", "postgres", "--children", "--sort", "sym", "-g", "none").splitlines():
        if m := LINE.match(line):
            children.setdefault(m.group(3), float(m.group(1)))
            selfs.append((float(m.group(2)), m.group(3)))
    out = [f"core 0: PostgreSQL {pg:.1f} % of the samples, our server {shares.get('mcp-tasks', 0.0):.1f} %",
           "", "inclusive, % of PostgreSQL's samples:"]  # fmt: skip
    for name, meaning in WATCHED:
        if name in children:
            out.append(f"  {100 * children[name] / pg:5.1f}  {name:<24} {meaning}")
    out += ["", f"self, top {top} named, % of PostgreSQL's samples:"]
    named = sorted((s for s in selfs if not s[1].startswith("0x")), reverse=True)[:top]
    out += [f"  {100 * share / pg:5.1f}  {name}" for share, name in named]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="lifecycle", choices=sorted(run.WORKLOADS))
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the sampled load (default %(default)s)")
    ap.add_argument("--tree", help="a checkout of our server to profile (a worktree sharing this venv)")
    ap.add_argument("--top", type=int, default=25, help="named functions listed by their own samples")
    ap.add_argument("--keep", type=Path, help="keep perf's data file here (for perf report)")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run.SERVER_TREE = args.tree
    dbs = run.Databases()
    server = None
    work = Path(tempfile.mkdtemp(prefix="mcp-pgprof-"))
    data = args.keep or work / "perf.data"
    try:
        dbs.create_template()
        server = run.start_ours(dbs.fresh(), work)
        run.pin_postgres(run.SERVER_CORE)
        run.run_load(server, args.workload, 3.0, work / "warm.json")  # plans cached, pools full
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-e", "cpu-clock", "-F", "500", "--call-graph", "dwarf,16384",
             "-C", run.SERVER_CORE, "-o", str(data), "--", "sleep", str(args.seconds)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        got = run.run_load(server, args.workload, args.seconds, work / "load.json")
        _, err = perf.communicate(timeout=args.seconds + 120)
        if perf.returncode != 0:
            print(f"perf record failed: {err.decode(errors='replace').strip()[-300:]}", file=sys.stderr)
            return 1
    finally:
        if server is not None:
            server.stop()
        dbs.drop_all()
    if "error" in got:
        print(got["error"], file=sys.stderr)
        return 1
    print(f"{args.workload}: {got['throughput_per_s']:.0f} ops/s while sampled")
    print(summarise(data, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
