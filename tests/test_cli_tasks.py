"""Issue 13, point 6: ``mcp-tasks tasks list|get|cancel`` against a real ``mcp-tasks serve``: pages,
JSON output, waiting for a result, and clear one-line errors with their own exit codes (not found,
not authorized, server down), never a traceback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import free_port, run_issuer
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession
from tests.test_durability import ROOT, mcp_tasks

pytestmark = pytest.mark.slow


def cli(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "tasks", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
        input=stdin,
    )  # fmt: skip


async def run(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    done = await asyncio.to_thread(cli, *argv, stdin=stdin)
    assert "Traceback" not in done.stderr, done.stderr
    return done


async def test_tasks_list_get_and_cancel_work_against_a_running_server(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """Issue 13, point 6: list pages through tasks/list (--all follows every cursor), get prints the
    task and --result waits for and prints its result, cancel cancels; --json prints the wire."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        s = RpcSession(http, url)
        await s.initialize()
        echoes = [
            (await s.call_tool_as_task("echo", {"text": f"e{i}"}))["task"]["taskId"] for i in range(52)
        ]  # more than a page (50)
        hung = (await s.call_tool_as_task("hang", {}))["task"]["taskId"]
        slow = (await s.call_tool_as_task("sleep", {"seconds": 1}))["task"]["taskId"]

        first = await run("list", "--url", url, "--json")
        everything = await run("list", "--url", url, "--json", "--all")
        text = await run("list", "--url", url)
        assert first.returncode == everything.returncode == text.returncode == 0, first.stderr + everything.stderr
        page = json.loads(first.stdout)
        assert len(page["tasks"]) == 50
        assert page["nextCursor"]
        listed = {t["taskId"] for t in json.loads(everything.stdout)["tasks"]}
        assert listed == {*echoes, hung, slow}
        assert f"--cursor={page['nextCursor']}" in text.stderr  # told how to get the next page
        rest = await run("list", "--url", url, "--json", "--cursor", page["nextCursor"])
        assert rest.returncode == 0, rest.stderr
        assert {t["taskId"] for t in json.loads(rest.stdout)["tasks"]} == listed - {t["taskId"] for t in page["tasks"]}

        got = await run("get", hung, "--url", url, "--json")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["status"] == "working"
        shown = await run("get", hung, "--url", url)
        assert f"taskId: {hung}" in shown.stdout
        assert "status: working" in shown.stdout

        result = await run("get", slow, "--url", url, "--result")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "slept 1s"
        as_json = await run("get", echoes[0], "--url", url, "--result", "--json")
        assert json.loads(as_json.stdout)["content"][0]["text"] == "e0"

        # A question the task asks while we wait arrives on the tasks/result stream: answered at the prompt.
        asking = (await s.call_tool_as_task("confirm", {"prompt": "Ship it?"}))["task"]["taskId"]
        answered = await run("get", asking, "--url", url, "--result", stdin="y\n")
        assert answered.returncode == 0, answered.stderr
        assert answered.stdout.strip() == "answer: ok=True"

        cancelled = await run("cancel", hung, "--url", url, "--json")
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["status"] == "cancelled"
        again = await run("cancel", hung, "--url", url)
        assert again.returncode == 1  # already terminal: the server's refusal, in one line
        assert again.stderr.count("\n") == 1

        # The 2026-07-28 wire reads the same task (its own rendering).
        modern = await run("get", slow, "--url", url, "--wire", "2026-07-28", "--json")
        assert modern.returncode == 0, modern.stderr
        assert json.loads(modern.stdout)["status"] == "completed"


async def test_tasks_commands_name_what_went_wrong_with_their_own_exit_codes(database_url: str) -> None:
    """Issue 13, point 6: expected conditions are one line on stderr and an exit code, never a
    traceback: unknown task (3), server down (5)."""
    async with mcp_tasks("serve", database_url) as (_proc, url):
        unknown = await run("get", "no-such-task", "--url", url)
        cancel_unknown = await run("cancel", "no-such-task", "--url", url, "--wire", "2026-07-28")
    assert unknown.returncode == 3, unknown.stderr
    assert "no-such-task" in unknown.stderr
    assert cancel_unknown.returncode == 3, cancel_unknown.stderr
    down = await run("list", "--url", f"http://127.0.0.1:{free_port()}/mcp", "--retry-for", "0")
    assert down.returncode == 5, down.stderr
    assert down.stderr.count("\n") == 1
    usage = await run("get")
    assert usage.returncode == 2


async def test_tasks_commands_without_a_valid_token_say_so(database_url: str) -> None:
    """Issue 13, point 6: a hosted server refuses the command without a token (401): exit 4, one
    line naming --token; with a token it works."""
    async with (
        run_issuer(LocalIssuer()) as issuer,
        mcp_tasks("serve", database_url, MCP_TASKS_AUTH="oauth", MCP_TASKS_OAUTH_ISSUER=issuer.url) as (_proc, url),
    ):
        token = issuer.mint(url, tenant_id="t-cli", sub="alice")
        refused = await run("list", "--url", url)
        wrong = await run("get", "x", "--url", url, "--token", "not-a-jwt", "--wire", "2026-07-28")
        allowed = await run("list", "--url", url, "--token", token, "--json")
    assert refused.returncode == 4, refused.stderr
    assert "--token" in refused.stderr
    assert wrong.returncode == 4, wrong.stderr
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout) == {"tasks": []}


def test_a_task_id_that_begins_with_a_dash_is_read_as_the_task_id() -> None:
    """One task id in 64 begins with "-" (URL-safe base64); argparse took it for options and
    `mcp-tasks tasks get <id>` failed with "the following arguments are required: task_id"."""
    from service.cli_tasks import protect_task_ids

    dashed = "-U2TSycvlYvIGt9ojA-trpH-9QosYREhAbCdEfGhIjK"
    assert len(dashed) == 43
    assert protect_task_ids(["tasks", "get", dashed, "--json"]) == ["tasks", "get", "--json", "--", dashed]
    assert protect_task_ids(["tasks", "cancel", "--url", "http://x/mcp", dashed]) == [
        "tasks", "cancel", "--url", "http://x/mcp", "--", dashed,
    ]  # fmt: skip
    plain = ["tasks", "get", "U2TSycvlYvIGt9ojA-trpH-9QosYREhAbCdEfGhIjK-"]
    assert protect_task_ids(plain) == plain
    already = ["tasks", "get", "--", dashed]
    assert protect_task_ids(already) == already
    result = subprocess.run(
        [sys.executable, "-m", "service", "tasks", "get", dashed, "--url", "http://127.0.0.1:9/mcp", "--retry-for", "0"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert "arguments are required" not in result.stderr
    assert result.returncode == 5, result.stderr  # server down: exit 5, not a usage error (2)


def test_a_cursor_that_begins_with_a_dash_is_read_as_the_cursor() -> None:
    """A cursor is URL-safe base64 of an HMAC tag first: one in 32 begins with "-", and
    `mcp-tasks tasks list --cursor <it>` failed with "expected one argument" (exit 2, nothing on
    stdout: the flaky page test of the sixth session). The hint prints `--cursor=C` as well."""
    from service.cli_tasks import protect_task_ids

    dashed = "-q3xW9xkVb0aKZl2m4s8"
    assert protect_task_ids(["tasks", "list", "--cursor", dashed, "--json"]) == [
        "tasks", "list", f"--cursor={dashed}", "--json",
    ]  # fmt: skip
    plain = ["tasks", "list", "--cursor", "q3xW9", "--all"]
    assert protect_task_ids(plain) == plain
    result = subprocess.run(
        [sys.executable, "-m", "service", "tasks", "list", "--cursor", dashed, "--url", "http://127.0.0.1:9/mcp",
         "--retry-for", "0"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert "expected one argument" not in result.stderr
    assert result.returncode == 5, result.stderr  # server down: exit 5, not a usage error (2)
