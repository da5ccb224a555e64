"""Issue 45, item 1: the client commands (`call`, `tasks`, `tools`) against real servers end with the
README's exit code for every outcome and one line on stderr, never a traceback; one Ctrl-C ends
them, at a prompt too (a real pseudo-terminal); `tasks` finds the tasks `call` made."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, http_client, make_settings, run_issuer, serve
from tests.ext import V2026Client
from tests.faults.proxy import tcp_proxy
from tests.issuer import LocalIssuer
from tests.test_durability import ROOT, mcp_tasks

pytestmark = pytest.mark.slow


@pytest.fixture
def state_home(tmp_path: Path) -> dict[str, str]:
    """The environment of a CLI run: its own history of tasks made by `call` (XDG_STATE_HOME)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_")}
    return {**env, "XDG_STATE_HOME": str(tmp_path / "state")}


def mcp(env: dict[str, str], *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "service", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90,
        input=stdin,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") <= 1 or done.returncode in (0, 1), done.stderr  # an error is one line
    return done


async def run(env: dict[str, str], *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(mcp, env, *argv, stdin=stdin)


async def test_every_exit_code_of_the_readme_table(database_url: str, state_home: dict[str, str]) -> None:
    """0 done, 1 refused or ended badly, 2 usage (a --url without the endpoint's path too), 3 no
    such task, 5 unreachable; 4 and 130 and 141 have tests of their own below."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        done = await run(state_home, "call", "echo", "--arg", "text=hi", "--url", url)
        tool_error = await run(state_home, "call", "fail", "--arg", "message=no", "--url", url)
        unknown_tool = await run(state_home, "call", "no-such-tool", "--url", url)
        no_path = await run(state_home, "call", "echo", "--url", url.removesuffix("mcp"))
        wrong_path = await run(state_home, "tasks", "list", "--url", url + "x")
        bad_json = await run(state_home, "call", "echo", "--json-arg", "text={", "--url", url)
        unknown_task = await run(state_home, "tasks", "get", "no-such-task", "--url", url)
        legacy_unknown = await run(state_home, "tasks", "cancel", "no-such-task", "--url", url, "--wire", "2025-11-25")
    down = await run(state_home, "call", "echo", "--url", f"http://127.0.0.1:{free_port()}/mcp")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["content"][0]["text"] == "hi"
    assert tool_error.returncode == 1, tool_error.stderr
    assert unknown_tool.returncode == 1, unknown_tool.stderr
    assert (no_path.returncode, no_path.stdout) == (2, ""), no_path.stderr  # not `{}` and 0
    assert (wrong_path.returncode, wrong_path.stdout) == (2, ""), wrong_path.stderr
    assert bad_json.returncode == 2, bad_json.stderr
    assert unknown_task.returncode == legacy_unknown.returncode == 3, unknown_task.stderr + legacy_unknown.stderr
    assert down.returncode == 5, down.stderr


async def test_a_missing_or_refused_token_is_exit_4(database_url: str, state_home: dict[str, str]) -> None:
    async with (
        run_issuer(LocalIssuer()) as issuer,
        mcp_tasks("serve", database_url, MCP_TASKS_AUTH="oauth", MCP_TASKS_OAUTH_ISSUER=issuer.url) as (_proc, url),
    ):
        refused = await run(state_home, "call", "echo", "--arg", "text=x", "--url", url)
        tools = await run(state_home, "tools", "--url", url, "--token", "not-a-jwt")
        token = issuer.mint(url, tenant_id="t-exit", sub="alice")
        allowed = await run(state_home, "tools", "--url", url, "--token", token)
    assert refused.returncode == tools.returncode == 4, refused.stderr + tools.stderr
    assert allowed.returncode == 0, allowed.stderr


async def test_a_closed_stdout_is_exit_141_without_a_traceback(database_url: str, state_home: dict[str, str]) -> None:
    """`mcp-tasks tasks list | head -1`: the reader goes away before the list is written."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        await run(state_home, "call", "echo", "--arg", "text=hi", "--url", url)
        read, write = os.pipe()
        os.close(read)  # nobody will read: the first write gets EPIPE, as after `head` exits
        proc = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "service", "tasks", "list", "--json", "--url", url],
            cwd=ROOT, env=state_home, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


async def test_tasks_list_get_and_cancel_find_the_task_call_made(database_url: str, state_home: dict[str, str]) -> None:
    """`call` speaks 2026-07-28, which has no tasks/list: `tasks list` still shows its task beside
    the 2025-11-25 ones, and `tasks get|cancel` read it without --wire (XD-3)."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        env = {**state_home}
        made = await run(env, "call", "sleep", "--arg", "seconds=1", "--url", url)
        assert made.returncode == 0, made.stderr
        task_id = re.search(r"task (\S+) working", made.stderr)[1]  # type: ignore[index]
        listed = await run(env, "tasks", "list", "--url", url, "--json")
        got = await run(env, "tasks", "get", task_id, "--url", url, "--json")
        result = await run(env, "tasks", "get", task_id, "--url", url, "--result")
    assert listed.returncode == 0, listed.stderr
    assert task_id in {t["taskId"] for t in json.loads(listed.stdout)["tasks"]}
    assert (got.returncode, json.loads(got.stdout)["status"]) == (0, "completed")
    assert (result.returncode, result.stdout.strip()) == (0, "slept 1s")


@pytest.mark.parametrize("argv", [["config"], ["config", "--json"]])
def test_any_command_with_a_closed_stdout_is_exit_141_without_a_traceback(
    argv: list[str], state_home: dict[str, str]
) -> None:
    """`mcp-tasks config | head` and the like: every command, not only the client ones."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "service", *argv], cwd=ROOT, env=state_home, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


async def test_call_shows_the_progress_of_its_task_on_the_default_wire(
    database_url: str, state_home: dict[str, str]
) -> None:
    """Issue 45, point 1: `call` speaks 2026-07-28, where a task sends no progress (X-NOTIF-8); the
    task's status message carries it, and `call` shows each one it sees."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        made = await run(state_home, "call", "sleep", "--arg", "seconds=3", "--url", url)
        quick = await run(state_home, "call", "count", "--arg", "n=3", "--arg", "interval_ms=20", "--url", url)
    assert (made.returncode, json.loads(made.stdout)["content"][0]["text"]) == (0, "slept 3s"), made.stderr
    assert re.search(r"status working \d+ % — slept \d of 3s", made.stderr), made.stderr
    # A call that ends inside its request streams its progress there (XD-18).
    assert quick.returncode == 0, quick.stderr
    assert "progress 3/3 counted 3 of 3" in quick.stderr, quick.stderr


async def test_tools_lists_each_tool_with_its_task_support_and_arguments(
    database_url: str, state_home: dict[str, str]
) -> None:
    async with mcp_tasks("serve", database_url) as (_proc, url):
        as_json = await run(state_home, "tools", "--url", url, "--json")
        table = await run(state_home, "tools", "--url", url)
    assert as_json.returncode == table.returncode == 0, as_json.stderr + table.stderr
    tools = {t["name"]: t for t in json.loads(as_json.stdout)["tools"]}
    assert tools["sleep"]["execution"]["taskSupport"] in ("optional", "required")
    rows = {line.split()[0]: line.split()[1:] for line in table.stdout.splitlines()[1:]}
    assert set(rows) == set(tools)
    assert rows["sleep"][0] == tools["sleep"]["execution"]["taskSupport"]
    assert rows["sleep"][1].startswith("seconds")


def _read_until(fd: int, pattern: bytes, timeout: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while pattern not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {pattern!r} within {timeout} s; saw {seen!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    return seen


def _ctrl_c_at_the_prompt(env: dict[str, str], url: str, *wire: str) -> tuple[int, str]:
    """`mcp-tasks call confirm` on a real terminal: wait for the y/N prompt, press Ctrl-C once."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty, as in a shell
        os.chdir(ROOT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a shell's foreground job, even under a runner that ignores it
        os.execve(sys.executable, [sys.executable, "-m", "service", "call", "confirm", "--url", url, *wire], env)
    try:
        before = _read_until(fd, b"[y/N]", 60)
        os.write(fd, b"\x03")  # the terminal turns it into SIGINT for the foreground process
        after = _read_until(fd, b"\n\xff", 30)  # everything until the child closes the terminal
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), (before + after).decode(errors="replace")


async def test_one_ctrl_c_at_the_prompt_ends_call_and_says_how_to_resume(
    database_url: str, state_home: dict[str, str]
) -> None:
    """2026-07-28 asks before any task exists (X-CREATE-5): nothing to resume. 2025-11-25 asks
    from the task: it stays input_required, and `tasks get --result` answers it later."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        code, screen = await asyncio.to_thread(_ctrl_c_at_the_prompt, state_home, url)
        assert code == 130, screen
        assert "Traceback" not in screen
        assert not re.search(r"task \S+ working", screen)
        code, screen = await asyncio.to_thread(_ctrl_c_at_the_prompt, state_home, url, "--wire", "2025-11-25")
        assert code == 130, screen
        assert "Traceback" not in screen
        task_id = re.search(r"task (\S+) working", screen)[1]  # type: ignore[index]
        last = [line for line in screen.splitlines() if line.strip()][-1]
        assert task_id in last  # the one line names the task to resume or cancel
        still = await run(state_home, "tasks", "get", task_id, "--url", url, "--json")
        assert json.loads(still.stdout)["status"] == "input_required"
        answered = await run(state_home, "tasks", "get", task_id, "--url", url, "--result", stdin="y\n")
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.strip() == "answer: ok=True"


async def test_ctrl_c_while_a_task_runs_is_exit_130(database_url: str, state_home: dict[str, str]) -> None:
    async with mcp_tasks("serve", database_url) as (_proc, url):
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "call", "hang", "--url", url], cwd=ROOT, env=state_home,
            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            # Ctrl-C reaches it as it would a shell's foreground job, even under a runner that ignores
            # SIGINT (a background job's children inherit the ignore, and Python then never raises).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        assert proc.stderr is not None
        first = await asyncio.to_thread(proc.stderr.readline)  # "task <id> working": it exists now
        proc.send_signal(signal.SIGINT)
        _out, rest = await asyncio.to_thread(proc.communicate, timeout=30)
    assert proc.returncode == 130, first + rest
    assert "Traceback" not in rest
    assert first.split()[1] in rest.strip().splitlines()[-1]


async def test_a_database_outage_on_2026_07_28_is_retried_not_final(
    admin_dsn: str, database_url: str, state_home: dict[str, str]
) -> None:
    """X-ERR-2: -31001 with HTTP 503 means "retry shortly"; `tasks get` waits it out."""
    async with tcp_proxy() as proxy:
        via_proxy = re.sub(r"@[^/]+/", f"@127.0.0.1:{proxy.port}/", database_url)
        async with serve(make_settings(via_proxy)) as server, http_client() as http:
            made = await run(state_home, "call", "echo", "--arg", "text=kept", "--url", server.url)
            assert made.returncode == 0, made.stderr
            created = await _create_modern_task(http, server.url)
            proxy.cut(refuse=True)
            getting = asyncio.create_task(
                run(state_home, "tasks", "get", created, "--url", server.url, "--retry-for", "60", "--json")
            )
            await _until_unavailable(http, server.url, created)
            proxy.heal()
            got = await getting
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["taskId"] == created


async def _create_modern_task(http: httpx.AsyncClient, url: str) -> str:
    result = await V2026Client(http, url).result("tools/call", {"name": "hang", "arguments": {}})
    assert result["resultType"] == "task", result
    return str(result["taskId"])


async def _until_unavailable(http: httpx.AsyncClient, url: str, task_id: str) -> None:
    client = V2026Client(http, url)
    async with asyncio.timeout(30):
        while (await client.post("tasks/get", {"taskId": task_id})).status_code != 503:
            await asyncio.sleep(0.1)
