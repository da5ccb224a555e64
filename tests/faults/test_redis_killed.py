"""Redis, the shared rate-limit storage, killed under load (issue 13, points 4 and 7)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import pytest

from tests.conftest import http_client
from tests.faults.harness import FaultClient, OperationFailed, Tally, figures, judge, redis_server, replicas, settle

PHASE_S = 2.5


def storage_errors(metrics_text: str) -> float:
    found = re.search(r"^mcp_tasks_rate_limit_storage_errors_total (\S+)$", metrics_text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_redis_killed_fails_open_or_closed_as_set_and_recovers(
    database_url: str, tmp_path: Path, mode: str
) -> None:
    """Issue 13, point 7 (Redis killed while rate limits are on) and point 4 (MCP_TASKS_RATE_LIMIT_FAIL):
    with "open", requests keep being answered while Redis is down; with "closed", they get 503 +
    Retry-After (never a 500 or -32603), which the clients retry; both log the loss once and the
    recovery once, count it in mcp_tasks_rate_limit_storage_errors_total, and recover by themselves
    when Redis is back. No client operation fails, no task is lost, stuck or run twice."""
    runs_log = tmp_path / "runs.log"
    tally = Tally(phase="before")
    known: dict[str, str] = {}
    stop = asyncio.Event()
    async with (
        redis_server() as redis, replicas(
            database_url, tmp_path, ("a",),
            MCP_TASKS_RATE_LIMIT_STORAGE=redis.url, MCP_TASKS_RATE_LIMIT_FAIL=mode, FAULTS_RUNS_LOG=str(runs_log),
        ) as fleet,
        http_client() as http,
    ):  # fmt: skip
        a = fleet["a"]

        async def traffic(seed: int) -> None:
            client = FaultClient(http, [a.url], tally, seed)
            with contextlib.suppress(OperationFailed):
                await client.initialize()
                n = 0
                while not stop.is_set():
                    n += 1
                    if n % 2:
                        await client.request("tools/call", {"name": "echo", "arguments": {"text": "hi"}})
                        continue
                    tool = "work_once" if n % 4 else "work"
                    task_id = await client.create(tool, {"seconds": 0.1})
                    known[task_id] = tool
                    await client.follow(task_id, use_result=n % 3 == 0)

        clients = [asyncio.create_task(traffic(i)) for i in range(4)]
        await asyncio.sleep(PHASE_S)
        errors_before = storage_errors((await http.get(a.base + "/metrics")).text)
        tally.phase = "outage"
        await redis.kill()
        await asyncio.sleep(PHASE_S)
        tally.phase = "restarted"
        await redis.start()
        await asyncio.sleep(PHASE_S + 1)  # the first request after the restart sees it
        tally.phase = "after"
        stop.set()
        await asyncio.gather(*clients)
        rows = await settle(database_url, set(known), timeout=15)
        errors_after = storage_errors((await http.get(a.base + "/metrics")).text)
        log = a.log()

    lost, stuck, duplicated, _runs = judge(rows, known, runs_log)
    outage_503 = tally.retries_in[("outage", "http503")]
    other = {k: n for k, n in tally.retries.items() if k != "http503"}
    figures(
        f"redis-killed-fail-{mode}",
        failed_ops=tally.failed_ops, lost=lost, stuck=stuck, duplicated=len(duplicated),
        ops=tally.ops, answered_in_outage=tally.answered["outage"], refused_503_in_outage=outage_503,
        answered_after_restart=tally.answered["restarted"], other_errors=sum(other.values()),
        storage_errors_counted=int(errors_after - errors_before),
    )  # fmt: skip
    print(f"  retries by phase and kind: {dict(tally.retries_in)}; failures: {dict(tally.failures)} {tally.examples}")
    assert (tally.failed_ops, lost, stuck, len(duplicated)) == (0, 0, 0, 0), (tally.examples, log[-3000:])
    assert not other, other  # no 500, no -32603, nothing but the 503s of a closed limiter
    assert errors_after > errors_before
    if mode == "open":
        assert tally.answered["outage"] > 20
        assert outage_503 == 0
    else:
        assert outage_503 > 0
    assert tally.answered["restarted"] > 20  # recovered without a restart of the service
    assert log.count("rate limit storage unreachable") == 1, log[-3000:]
    assert log.count("rate limit storage reachable again") == 1, log[-3000:]
