"""Upstream MCP servers as durable tasks (issue 41): real upstream servers written with the official
MCP Python SDK (tests/upstream_server.py), started as subprocesses over Streamable HTTP and stdio,
behind a real `serve`; both of our wires call their tools."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from service.upstream.config import UpstreamConfigError, check_no_clash, load
from tests.conftest import RunningServer, free_port, make_settings, run_issuer, serve
from tests.ext import V2026Client
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession, sse_messages
from tests.test_durability import ROOT, mcp_tasks

UPSTREAM = [sys.executable, "-m", "tests.upstream_server"]


@contextlib.contextmanager
def http_upstream(marks: Path, port: int | None = None) -> Iterator[str]:
    """The test upstream over Streamable HTTP; its URL once it answers."""
    port = port or free_port()
    with server_process([*UPSTREAM, "http", str(port), "--marks", str(marks)], port) as url:
        yield url


@contextlib.contextmanager
def server_process(argv: list[str], port: int) -> Iterator[str]:
    """An upstream server started as ``argv`` (run from the project root), listening on ``port``:
    its /mcp URL once it answers HTTP at all; stopped when the block ends."""
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url, timeout=0.5)
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the test upstream ({' '.join(argv[1:3])}) exited at start")
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the test upstream ({' '.join(argv[1:3])}) did not answer {url} within 10 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def upstreams_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "upstreams.toml"
    path.write_text(body)
    return str(path)


def stdio_table(marks: Path, name: str = "local", extra: str = "") -> str:
    command = ", ".join(f'"{part}"' for part in [*UPSTREAM, "stdio", "--marks", str(marks)])
    return f'[[upstream]]\nname = "{name}"\ncommand = [{command}]\ncwd = "{ROOT}"\n{extra}\n'


@contextlib.asynccontextmanager
async def service(tmp_path: Path, database_url: str, body: str, **overrides: Any) -> AsyncIterator[RunningServer]:
    settings = make_settings(database_url, upstreams_file=upstreams_file(tmp_path, body), **overrides)
    async with serve(settings) as running:
        yield running


async def until(check: Any, timeout: float = 20) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            value = await check()
            if value:
                return value
            await asyncio.sleep(0.05)


async def task_outcome(s: RpcSession, task_id: str) -> dict[str, Any]:
    async def finished() -> dict[str, Any] | None:
        task = await s.result("tasks/get", {"taskId": task_id})
        return task if task["status"] in ("completed", "failed", "cancelled") else None

    task: dict[str, Any] = await until(finished)
    return task


@pytest.fixture
def marks(tmp_path: Path) -> Path:
    path = tmp_path / "marks"
    path.mkdir()
    return path


# ---- the file --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\ncolour = "red"\n', ["'a'", "colour", "unknown key"]),
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\n[[upstream]]\nname = "a"\nurl = "http://y/mcp"\n',
         ["'a'", "name", "two upstreams"]),
        ('[[upstream]]\nname = "A b"\nurl = "http://x/mcp"\n', ["name", "[a-z0-9-]+"]),
        ('[[upstream]]\nname = "a"\n', ["'a'", "url", "exactly one"]),
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\ntimeout_s = -1\n', ["'a'", "timeout_s"]),
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\ntask_support = "sometimes"\n', ["'a'", "task_support"]),
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\n[upstream.auth]\nbearer_env = "NO_SUCH_VAR_41"\n',
         ["'a'", "auth.bearer_env", "NO_SUCH_VAR_41"]),
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\n[upstream.auth]\nclient_credentials = '
         '{ token_url = "http://t/token", client_id = "c", client_secret_env = "NO_SUCH_SECRET_41" }\n',
         ["'a'", "client_secret_env", "NO_SUCH_SECRET_41"]),
        ('[[upstream]]\nname = "a"\ncommand = ["x"]\n[upstream.forward]\ntenant_header = "X-Tenant"\n',
         ["'a'", "forward", "HTTP upstream"]),
        ('[[upstream]]\nname = "a"\nurl = "http://x/mcp"\n[upstream.forward]\ntenant_header = "Authorization"\n',
         ["'a'", "forward.tenant_header"]),
        ("[[upstream]\n", ["not valid TOML"]),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_with_one_line_naming_the_upstream_and_the_key(
    tmp_path: Path, body: str, names: list[str]
) -> None:
    with pytest.raises(UpstreamConfigError) as caught:
        load(upstreams_file(tmp_path, body), environ={})
    message = str(caught.value)
    assert "\n" not in message
    for name in names:
        assert name in message


def test_an_upstream_named_over_a_pack_tool_is_refused() -> None:
    upstreams = load_text('[[upstream]]\nname = "demo"\nurl = "http://x/mcp"\n')
    with pytest.raises(UpstreamConfigError, match=r"'demo'.*demo\.echo"):
        check_no_clash(upstreams, ["demo.echo", "sleep"])


def load_text(body: str) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return load(upstreams_file(Path(d), body), environ={})


def test_serve_with_a_bad_file_stops_with_one_line(tmp_path: Path) -> None:
    path = upstreams_file(tmp_path, '[[upstream]]\nname = "up"\nurl = "http://x/mcp"\nretries = 3\n')
    env = {**os.environ, "MCP_TASKS_UPSTREAMS_FILE": path, "MCP_TASKS_DATABASE_URL": "postgresql://unused/x"}
    done = subprocess.run([sys.executable, "-m", "service", "serve"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("mcp-tasks: MCP_TASKS_UPSTREAMS_FILE:")
    assert "'up'" in done.stderr
    assert "retries" in done.stderr
    assert "Traceback" not in done.stderr


# ---- calls over Streamable HTTP ----------------------------------------------------------------


async def test_an_http_upstreams_tools_are_listed_and_run_as_tasks_on_both_wires(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with http_upstream(marks) as url:
        body = f'[[upstream]]\nname = "up"\nurl = "{url}"\nexclude = ["big"]\n'
        async with service(tmp_path, database_url, body) as server:
            s = RpcSession(http, server.url)
            await s.initialize()
            tools = {t["name"]: t for t in (await s.result("tools/list"))["tools"]}
            assert {"up.echo", "up.sleep", "up.confirm", "up.hang"} <= set(tools)
            assert "up.big" not in tools  # excluded
            assert tools["up.echo"]["inputSchema"]["required"] == ["text"]
            assert tools["up.echo"]["description"] == "Return the text."
            assert tools["up.echo"]["execution"] == {"taskSupport": "optional"}

            task = (await s.call_tool_as_task("up.echo", {"text": "over http"}))["task"]
            assert (await task_outcome(s, task["taskId"]))["status"] == "completed"
            result = await s.result("tasks/result", {"taskId": task["taskId"]})
            assert result["content"] == [{"type": "text", "text": "over http"}]
            conn = await asyncpg.connect(database_url)
            try:  # the audit record names the upstream and its tool
                rows = await conn.fetch("SELECT action, detail FROM audit_events WHERE task_id = $1", task["taskId"])
            finally:
                await conn.close()
            create = orjson.loads(next(r["detail"] for r in rows if r["action"] == "create"))
            assert create["tool"] == "up.echo"
            assert (create["upstream"], create["upstream_tool"]) == ("up", "echo")
            assert {r["action"] for r in rows} >= {"create", "complete", "retrieve"}

            plain = await s.result("tools/call", {"name": "up.echo", "arguments": {"text": "plain"}})
            assert plain["content"][0]["text"] == "plain"

            c = V2026Client(http, server.url)
            listed = {t["name"] for t in (await c.result("tools/list"))["tools"]}
            assert "up.echo" in listed
            created = await c.result("tools/call", {"name": "up.sleep", "arguments": {"seconds": 1.5}})
            assert created["resultType"] == "task"
            task_id = created["task"]["taskId"] if "task" in created else created["taskId"]

            async def progressed() -> dict[str, Any] | None:
                got = await c.result("tasks/get", {"taskId": task_id})
                return got if "%" in (got.get("statusMessage") or "") else None

            assert "step" in (await until(progressed))["statusMessage"]  # upstream progress → statusMessage

            async def done() -> dict[str, Any] | None:
                got = await c.result("tasks/get", {"taskId": task_id})
                return got if got["status"] == "completed" else None

            finished = await until(done)
            assert finished["result"]["content"][0]["text"] == "slept 1.5s"


async def test_an_upstreams_list_changed_reaches_our_get_streams_and_listens_and_the_new_tool_runs(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """Issue 41 §2: the upstream's notifications/tools/list_changed is followed, and told on to our
    2025-11-25 sessions' GET streams and to 2026-07-28 listens that asked for toolsListChanged."""
    with http_upstream(marks) as url:
        async with service(tmp_path, database_url, f'[[upstream]]\nname = "up"\nurl = "{url}"\n') as server:
            s = RpcSession(http, server.url)
            assert (await s.initialize())["capabilities"]["tools"] == {"listChanged": True}
            assert "up.grown" not in {t["name"] for t in (await s.result("tools/list"))["tools"]}
            c = V2026Client(http, server.url)
            discovered = await c.result("server/discover")
            assert discovered["capabilities"]["tools"] == {"listChanged": True}
            opened = [asyncio.Event(), asyncio.Event()]

            async def on_get_stream() -> dict[str, Any]:
                headers = {**s.headers(), "Accept": "text/event-stream"}
                async with http.stream("GET", s.url, headers=headers) as r:
                    assert r.status_code == 200
                    opened[0].set()
                    async for msg in sse_messages(r):
                        if msg.get("method") == "notifications/tools/list_changed":
                            return msg
                raise AssertionError("the GET stream ended without list_changed")

            async def on_listen() -> list[dict[str, Any]]:
                body = c.body("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
                seen = []
                async with http.stream("POST", c.url, content=orjson.dumps(body),
                                       headers=c.headers("subscriptions/listen")) as r:  # fmt: skip
                    assert r.status_code == 200
                    async for msg in sse_messages(r):
                        seen.append(msg)
                        opened[1].set()
                        if msg.get("method") == "notifications/tools/list_changed":
                            return seen
                raise AssertionError("the listen ended without list_changed")

            get_stream, listen = asyncio.create_task(on_get_stream()), asyncio.create_task(on_listen())
            async with asyncio.timeout(20):
                await asyncio.gather(*(e.wait() for e in opened))
                assert (await s.result("tools/call", {"name": "up.grow", "arguments": {}}))["content"][0][
                    "text"
                ] == "grew"
                told, seen = await get_stream, await listen
            assert told == {"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}}
            ack = seen[0]
            assert ack["method"] == "notifications/subscriptions/acknowledged"
            assert ack["params"]["notifications"] == {"toolsListChanged": True}
            subscription = ack["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"]
            assert seen[-1]["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == subscription
            tools = {t["name"] for t in (await s.result("tools/list"))["tools"]}
            assert "up.grown" in tools
            assert (await s.result("tools/call", {"name": "up.grown", "arguments": {}}))["content"][0][
                "text"
            ] == "grown"


async def test_upstream_elicitation_becomes_input_required_and_the_answer_goes_back(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with http_upstream(marks) as url:
        async with service(tmp_path, database_url, f'[[upstream]]\nname = "up"\nurl = "{url}"\n') as server:
            s = RpcSession(http, server.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("up.confirm", {"prompt": "Ship it?"}))["task"]["taskId"]

            async def waiting() -> bool:
                return bool((await s.result("tasks/get", {"taskId": task_id}))["status"] == "input_required")

            await until(waiting)
            final: dict[str, Any] = {}
            async for msg in s.stream("tasks/result", {"taskId": task_id}):
                if msg.get("method") == "elicitation/create":
                    assert msg["params"]["message"] == "Ship it?"
                    assert msg["params"]["requestedSchema"]["required"] == ["ok"]
                    await s.reply(msg["id"], {"action": "accept", "content": {"ok": True}})
                elif "result" in msg:
                    final = msg["result"]
            assert final["content"][0]["text"] == "ok=True"


async def test_cancel_reaches_the_upstream_and_an_idle_upstream_fails_the_task(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with http_upstream(marks) as url:
        body = f'[[upstream]]\nname = "up"\nurl = "{url}"\nidle_timeout_s = 1.5\n'
        async with service(tmp_path, database_url, body) as server:
            s = RpcSession(http, server.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("up.hang", {}))["task"]["taskId"]
            await until(lambda: _exists(marks / "hang-1.started"))
            await s.result("tasks/cancel", {"taskId": task_id})
            await until(lambda: _exists(marks / "hang-1.cancelled"))  # notifications/cancelled arrived

            idle = (await s.call_tool_as_task("up.hang", {}))["task"]["taskId"]
            failed = await task_outcome(s, idle)
            assert failed["status"] == "failed"
            assert "upstream 'up'" in failed["statusMessage"]
            assert "idle_timeout_s=1.5" in failed["statusMessage"]
            await until(lambda: _exists(marks / "hang-2.cancelled"))


async def test_timeout_s_holds_whatever_the_upstream_reports(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with http_upstream(marks) as url:
        body = f'[[upstream]]\nname = "up"\nurl = "{url}"\ntimeout_s = 1\nidle_timeout_s = 60\n'
        async with service(tmp_path, database_url, body) as server:
            s = RpcSession(http, server.url)
            await s.initialize()
            task_id = (await s.call_tool_as_task("up.sleep", {"seconds": 30}))["task"]["taskId"]
            failed = await task_outcome(s, task_id)
            assert failed["status"] == "failed"
            assert "timeout_s=1" in failed["statusMessage"]
            await until(lambda: _exists(marks / "sleep-1.cancelled"))  # we stopped waiting: so did the upstream


async def test_upstream_errors_and_oversized_results_fail_with_a_message_naming_the_upstream(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    with http_upstream(marks) as url:
        body = f'[[upstream]]\nname = "up"\nurl = "{url}"\n'
        async with service(tmp_path, database_url, body, max_result_bytes=64 * 1024) as server:
            s = RpcSession(http, server.url)
            await s.initialize()
            tool_error = await s.result("tools/call", {"name": "up.fail", "arguments": {"message": "no good"}})
            assert tool_error["isError"] is True
            assert "no good" in tool_error["content"][0]["text"]

            refused = (await s.call_tool_as_task("up.fail", {"message": "not today"}))["task"]["taskId"]
            assert "not today" in (await task_outcome(s, refused))["statusMessage"]  # the upstream's own words

            big = (await s.call_tool_as_task("up.big", {"kib": 100}))["task"]["taskId"]
            failed = await task_outcome(s, big)
            assert failed["status"] == "failed"
            assert "MCP_TASKS_MAX_RESULT_BYTES" in failed["statusMessage"]


async def test_an_upstream_down_at_start_is_picked_up_when_it_comes_up(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    port = free_port()
    body = f'[[upstream]]\nname = "late"\nurl = "http://127.0.0.1:{port}/mcp"\n'
    async with service(tmp_path, database_url, body) as server:
        s = RpcSession(http, server.url)
        await s.initialize()
        names = [t["name"] for t in (await s.result("tools/list"))["tools"]]
        assert not any(n.startswith("late.") for n in names)
        with http_upstream(marks, port):

            async def listed() -> bool:
                return any(t["name"] == "late.echo" for t in (await s.result("tools/list"))["tools"])

            await until(listed, timeout=30)
            task_id = (await s.call_tool_as_task("late.echo", {"text": "hi"}))["task"]["taskId"]
            assert (await task_outcome(s, task_id))["status"] == "completed"


# ---- stdio ------------------------------------------------------------------------------------


async def test_a_stdio_upstream_runs_tasks_relays_progress_and_its_death_fails_the_call(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MCP_TASKS_DATABASE_URL", database_url)  # as a deployed process has it
    table = stdio_table(marks, extra='env = { GREETING = "hi" }')
    async with service(tmp_path, database_url, table) as server:
        s = RpcSession(http, server.url)
        await s.initialize()
        names = {t["name"] for t in (await s.result("tools/list"))["tools"]}
        assert {"local.echo", "local.sleep", "local.die"} <= names
        for name, seen in (("GREETING", "hi"), ("MCP_TASKS_DATABASE_URL", "")):  # its table's, never ours
            got = await s.result("tools/call", {"name": "local.getenv", "arguments": {"name": name}})
            assert got["content"][0]["text"] == seen
        task_id = (await s.call_tool_as_task("local.echo", {"text": "over stdio"}))["task"]["taskId"]
        assert (await task_outcome(s, task_id))["status"] == "completed"

        seen = []
        async for msg in s.stream("tools/call", {"name": "local.sleep", "arguments": {"seconds": 0.6},
                                                 "_meta": {"progressToken": "p1"}}):  # fmt: skip
            seen.append(msg)
        progress = [m["params"] for m in seen if m.get("method") == "notifications/progress"]
        assert progress
        assert progress[-1]["progressToken"] == "p1"
        assert progress[-1]["progress"] == progress[-1]["total"]
        assert progress[-1]["message"].startswith("step ")
        assert seen[-1]["result"]["content"][0]["text"] == "slept 0.6s"

        died = (await s.call_tool_as_task("local.die", {}))["task"]["taskId"]
        failed = await task_outcome(s, died)
        assert failed["status"] == "failed"
        assert "upstream 'local'" in failed["statusMessage"]
        assert "closed the connection" in failed["statusMessage"]

        async def restarted() -> bool:  # the process is started again and serves the next call
            again = (await s.call_tool_as_task("local.echo", {"text": "again"}))["task"]["taskId"]
            return bool((await task_outcome(s, again))["status"] == "completed")

        await until(restarted, timeout=30)


async def _exists(path: Path) -> bool:
    return path.exists()


def test_without_upstreams_the_mcp_sdk_is_never_imported(database_url: str) -> None:
    """The SDK is the upstreams' client only: a service without them does not load it (the import
    contract checks the code; this checks a started core)."""
    code = (
        "import asyncio, sys\n"
        "from service.core import open_core\n"
        "from tests.conftest import make_settings\n"
        "async def main():\n"
        f"    core = await open_core(make_settings({database_url!r}))\n"
        "    await core.close()\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


async def test_two_tenants_are_told_apart_upstream_and_never_see_each_others_tasks(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream gets our credentials, never the caller's token, and the forward headers name
    each caller; tasks of the same upstream tool stay with their tenant."""
    monkeypatch.setenv("UPSTREAM_TOKEN_41", "ours-not-theirs")
    body = (
        '[[upstream]]\nname = "up"\nurl = "{url}"\n[upstream.auth]\nbearer_env = "UPSTREAM_TOKEN_41"\n'
        '[upstream.forward]\ntenant_header = "X-Tenant"\nsubject_header = "X-Subject"\n'
    )
    async with run_issuer(LocalIssuer()) as issuer:
        with http_upstream(marks) as url:
            overrides = {"auth": "oauth", "oauth_issuer": issuer.url}
            async with service(tmp_path, database_url, body.format(url=url), **overrides) as server:
                seen: dict[str, dict[str, Any]] = {}
                tasks: dict[str, str] = {}
                sessions: dict[str, RpcSession] = {}
                for tenant, subject in (("acme", "alice"), ("globex", "bob é")):
                    token = issuer.mint(server.url, tenant_id=tenant, sub=subject)
                    s = sessions[tenant] = RpcSession(http, server.url, token=token)
                    await s.initialize()
                    task_id = (await s.call_tool_as_task("up.whoami", {}))["task"]["taskId"]
                    assert (await task_outcome(s, task_id))["status"] == "completed"
                    seen[tenant] = (await s.result("tasks/result", {"taskId": task_id}))["structuredContent"]
                    tasks[tenant] = task_id
                    assert token not in str(seen[tenant])
                assert seen["acme"] == {"authorization": "Bearer ours-not-theirs", "x-tenant": "acme",
                                        "x-subject": "alice"}  # fmt: skip
                assert seen["globex"]["x-subject"] == "bob%20%C3%A9"  # not visible ASCII: percent-encoded
                other = await sessions["globex"].error("tasks/get", {"taskId": tasks["acme"]})
                assert other["code"] == -32602  # another tenant's task: not found
                listed = await sessions["globex"].result("tasks/list")
                assert [t["taskId"] for t in listed["tasks"]] == [tasks["globex"]]


async def test_the_circuit_opens_on_a_dead_upstream_and_closes_when_it_answers_again(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    port = free_port()
    body = (
        f'[[upstream]]\nname = "flaky"\nurl = "http://127.0.0.1:{port}/mcp"\ncircuit_failures = 2\ncircuit_open_s = 2\n'
    )
    with http_upstream(marks, port):
        running = service(tmp_path, database_url, body, upstream_down_grace_s=3600)
        server = await running.__aenter__()
    try:  # the upstream is gone; its tools stay listed within the grace
        s = RpcSession(http, server.url)
        await s.initialize()
        messages = []
        for _ in range(3):
            task_id = (await s.call_tool_as_task("flaky.echo", {"text": "x"}))["task"]["taskId"]
            failed = await task_outcome(s, task_id)
            assert failed["status"] == "failed"
            messages.append(failed["statusMessage"])
        assert all("could not be reached" in m for m in messages[:2]), messages
        assert "circuit open" in messages[2]
        assert "try again" in messages[2]
        metrics = (await http.get(server.url.replace("/mcp", "/metrics"))).text
        assert 'mcp_tasks_upstream_calls_total{outcome="refused",upstream="flaky"} 1.0' in metrics
        assert 'mcp_tasks_upstream_calls_total{outcome="error",upstream="flaky"} 2.0' in metrics
        with http_upstream(marks, port):
            await asyncio.sleep(2)  # circuit_open_s: then one call is let through, and it closes the circuit

            async def served() -> bool:
                task_id = (await s.call_tool_as_task("flaky.echo", {"text": "back"}))["task"]["taskId"]
                return bool((await task_outcome(s, task_id))["status"] == "completed")

            await until(served)
            metrics = (await http.get(server.url.replace("/mcp", "/metrics"))).text
            assert 'mcp_tasks_upstream_circuit_open{upstream="flaky"} 0.0' in metrics
    finally:
        await running.__aexit__(None, None, None)


async def test_sigkill_mid_call_fails_a_plain_upstreams_task_and_reruns_a_rerunnable_ones(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """Our process dies while the upstream works: the task of an upstream not marked rerunnable
    fails with a message saying so; one marked rerunnable is called again by the next runner."""
    with http_upstream(marks) as url:
        body = (
            f'[[upstream]]\nname = "once"\nurl = "{url}"\n'
            f'[[upstream]]\nname = "again"\nurl = "{url}"\nrerunnable = true\n'
        )
        env = {"MCP_TASKS_UPSTREAMS_FILE": upstreams_file(tmp_path, body), "MCP_TASKS_LEASE_MS": "3000"}
        async with mcp_tasks("serve", database_url, **env) as (proc, url_a):
            s = RpcSession(http, url_a)
            await s.initialize()
            once = (await s.call_tool_as_task("once.sleep", {"seconds": 600}))["task"]["taskId"]
            again = (await s.call_tool_as_task("again.sleep", {"seconds": 4}))["task"]["taskId"]
            await until(lambda: _count(marks, "sleep-*.started", 2))
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        async with mcp_tasks("serve", database_url, **env) as (_proc, url_b):
            s = RpcSession(http, url_b)
            await s.initialize()
            failed = await task_outcome(s, once)
            assert failed["status"] == "failed"
            assert "'once.sleep'" in failed["statusMessage"]
            assert "stopped before the task finished" in failed["statusMessage"]
            assert (await task_outcome(s, again))["status"] == "completed"
            assert len(list(marks.glob("sleep-*.started"))) == 3  # the rerunnable one, called again


async def _count(marks: Path, pattern: str, n: int) -> bool:
    return len(list(marks.glob(pattern))) >= n


async def test_a_2026_call_of_an_upstream_tool_that_asks_becomes_a_task_and_the_upstream_runs_it_once(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """An upstream tool cannot be run again with the answers (MRTR): a declaring call that asks
    becomes a task first, and the question waits in input_required (X-INPUT-*); a call that cannot
    become a task is refused with a message saying how to call it."""
    with http_upstream(marks) as url:
        async with service(tmp_path, database_url, f'[[upstream]]\nname = "up"\nurl = "{url}"\n') as server:
            c = V2026Client(http, server.url)
            created = await c.result("tools/call", {"name": "up.confirm", "arguments": {"prompt": "Ship it?"}})
            assert created["resultType"] == "task"
            task_id = created["task"]["taskId"] if "task" in created else created["taskId"]

            async def asking() -> dict[str, Any] | None:
                got = await c.result("tasks/get", {"taskId": task_id})
                return got if got["status"] == "input_required" else None

            waiting = await until(asking)
            (key, question), *others = waiting["inputRequests"].items()
            assert not others
            assert question["method"] == "elicitation/create"
            assert question["params"]["message"] == "Ship it?"
            nested = {key: {"action": "accept", "content": {"ok": {"nested": True}}}}  # not a form's value
            refused = await c.error("tasks/update", {"taskId": task_id, "inputResponses": nested})
            assert refused["code"] == -32602  # X-UPDATE-8: the question still waits, nothing reached the upstream
            assert (await c.result("tasks/get", {"taskId": task_id}))["status"] == "input_required"
            await c.result("tasks/update", {"taskId": task_id,
                                            "inputResponses": {key: {"action": "accept", "content": {"ok": True}}}})  # fmt: skip

            async def done() -> dict[str, Any] | None:
                got = await c.result("tasks/get", {"taskId": task_id})
                return got if got["status"] == "completed" else None

            assert (await until(done))["result"]["content"][0]["text"] == "ok=True"
            assert len(list(marks.glob("confirm-*.started"))) == 1  # one upstream call, never replayed

            plain = V2026Client(http, server.url, capabilities={"elicitation": {"form": {}}})  # not declaring
            answer = await plain.post("tools/call", {"name": "up.confirm", "arguments": {"prompt": "Again?"}})
            message = answer.json()
            text = str(message)
            assert "call it as a task" in text, message


async def test_the_upstreams_command_shows_what_each_process_sees_and_config_masks_secrets(
    tmp_path: Path, database_url: str, marks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPSTREAM_TOKEN_41", "s3cret-value")
    monkeypatch.setenv("UPSTREAM_SECRET_41", "client-s3cret")
    dead = free_port()
    with http_upstream(marks) as url:
        body = (
            f'[[upstream]]\nname = "up"\nurl = "{url}"\n[upstream.auth]\nbearer_env = "UPSTREAM_TOKEN_41"\n'
            f'[[upstream]]\nname = "ghost"\nurl = "http://127.0.0.1:{dead}/mcp"\n'
            # its token endpoint is down: so is it, and it is tried again (it says why)
            f'[[upstream]]\nname = "locked"\nurl = "{url}"\n[upstream.auth]\nclient_credentials = {{ token_url = '
            f'"http://127.0.0.1:{dead}/token", client_id = "c", client_secret_env = "UPSTREAM_SECRET_41" }}\n'
        )
        async with service(tmp_path, database_url, body):
            env = {**os.environ, "MCP_TASKS_DATABASE_URL": database_url,
                   "MCP_TASKS_UPSTREAMS_FILE": str(tmp_path / "upstreams.toml")}  # fmt: skip

            def run(*argv: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-m", "service", *argv], env=env, capture_output=True,
                                      text=True, timeout=60, cwd=ROOT)  # fmt: skip

            async def both_reported() -> dict[str, Any] | None:
                done = await asyncio.to_thread(run, "upstreams", "--json")
                assert done.returncode == 0, done.stderr
                rows = {r["upstream"]: r for r in map(orjson.loads, done.stdout.splitlines())}
                reported = rows.get("ghost", {}).get("process") and rows.get("locked", {}).get("last_error")
                return rows if rows.get("up", {}).get("state") == "up" and reported else None

            rows = await until(both_reported)
            assert "echo" in rows["up"]["tools"]
            assert rows["up"]["circuit"] == "closed"
            assert rows["up"]["tasks"] is None  # neither wire's tasks: its calls are plain calls
            assert rows["ghost"]["state"] == "down"
            assert rows["ghost"]["down_since"]
            assert "cannot connect" in rows["ghost"]["last_error"]
            assert rows["locked"]["state"] == "down"
            assert "no token from" in rows["locked"]["last_error"]
            shown = await asyncio.to_thread(run, "config")
            assert shown.returncode == 0, shown.stderr
            assert "s3cret-value" not in shown.stdout
            assert "client-s3cret" not in shown.stdout
            assert "bearer from $UPSTREAM_TOKEN_41" in shown.stdout
            assert '"timeout_s": 3600.0' in shown.stdout  # defaults filled in


async def test_a_reused_session_the_upstream_dropped_is_replaced_without_failing_the_call(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """Idle sessions are reused; an upstream restarted meanwhile no longer knows them (404): the
    call goes again on a new session, since the old one never reached the tool."""
    port = free_port()
    body = f'[[upstream]]\nname = "up"\nurl = "http://127.0.0.1:{port}/mcp"\n'
    with http_upstream(marks, port):
        running = service(tmp_path, database_url, body, upstream_down_grace_s=3600)
        server = await running.__aenter__()
        s = RpcSession(http, server.url)
        await s.initialize()
        first = await s.result("tools/call", {"name": "up.echo", "arguments": {"text": "one"}})
        assert first["content"][0]["text"] == "one"
    try:
        with http_upstream(marks, port):  # the same address, a new process: our idle session is unknown there
            again = await s.result("tools/call", {"name": "up.echo", "arguments": {"text": "two"}})
            assert again.get("isError") is not True, again
            assert again["content"][0]["text"] == "two"
    finally:
        await running.__aexit__(None, None, None)


async def test_a_stdio_question_waiting_for_its_answer_holds_up_no_other_call(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """The SDK answers a server's request inside its receive loop; ours answers questions beside
    it, so a stdio server's one session keeps serving other calls while a person thinks."""
    async with service(tmp_path, database_url, stdio_table(marks)) as server:
        s = RpcSession(http, server.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("local.confirm", {"prompt": "Wait?"}))["task"]["taskId"]

        async def asking() -> bool:
            return bool((await s.result("tasks/get", {"taskId": task_id}))["status"] == "input_required")

        await until(asking)
        async with asyncio.timeout(10):
            echoed = await s.result("tools/call", {"name": "local.echo", "arguments": {"text": "meanwhile"}})
        assert echoed["content"][0]["text"] == "meanwhile"
        final: dict[str, Any] = {}
        async for msg in s.stream("tasks/result", {"taskId": task_id}):
            if msg.get("method") == "elicitation/create":
                await s.reply(msg["id"], {"action": "accept", "content": {"ok": True}})
            elif "result" in msg:
                final = msg["result"]
        assert final["content"][0]["text"] == "ok=True"


def test_only_a_refusal_of_initialize_sends_an_upstream_to_2026_07_28() -> None:
    """An answered refusal (a JSON-RPC error, HTTP 400/404/405/406/415) may mean "2026-07-28 only";
    a refused credential, a busy or broken server, a timeout or no connection means down."""
    from mcp.shared.exceptions import McpError
    from mcp.types import ErrorData

    from service.upstream.connection import refused_initialize

    request = httpx.Request("POST", "http://upstream/mcp")

    def status(code: int) -> httpx.HTTPStatusError:
        return httpx.HTTPStatusError("HTTP", request=request, response=httpx.Response(code, request=request))

    assert refused_initialize(ExceptionGroup("the SDK's task group", [status(400)]))
    assert refused_initialize(McpError(ErrorData(code=-32602, message="Unsupported protocol version")))
    for code in (401, 403, 429, 500, 503):
        assert not refused_initialize(status(code)), code
    assert not refused_initialize(httpx.ConnectError("connection refused"))
    assert not refused_initialize(TimeoutError())


def test_a_half_open_breaker_whose_trial_was_not_sent_lets_the_next_one_through() -> None:
    from service.upstream.breaker import Breaker

    breaker = Breaker(threshold=1, open_s=0)
    breaker.failed("down")
    assert breaker.state() == "half_open"
    assert breaker.refuses() is None  # the trial
    assert breaker.refuses() is not None  # one at a time
    breaker.settled()  # the trial was refused before it was sent
    assert breaker.refuses() is None


async def test_a_rerunnable_upstreams_call_that_dies_is_tried_again_with_backoff_and_then_fails(
    tmp_path: Path, database_url: str, marks: Path, http: httpx.AsyncClient
) -> None:
    """Retries only where the upstream is marked rerunnable: three attempts, then the failure says so;
    a plain upstream's dying call is tried once (the stdio test above)."""
    async with service(tmp_path, database_url, stdio_table(marks, extra="rerunnable = true")) as server:
        s = RpcSession(http, server.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("local.die", {}))["task"]["taskId"]
        failed = await task_outcome(s, task_id)
        assert failed["status"] == "failed"
        assert "tried 3 times" in failed["statusMessage"]
        # (an attempt made while the killed server is still starting again is refused, not sent)
        starts = sum(len(p.read_text().splitlines()) for p in marks.glob("die-*.started"))
        assert 2 <= starts <= 3
