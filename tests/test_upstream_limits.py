"""What an upstream cannot make us hold (issue 41's "never a hang"): connections kept for callers
who do not come back, a process whose server never answers initialize, a 2026-07-28 answer that
streams forever, credentials that cannot be read. Real upstream processes and sockets."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from service.upstream.auth import Credentials, UpstreamAuthError
from service.upstream.config import Bearer, UpstreamConfig
from service.upstream.connection import ConnectFailed, Connection
from service.upstream.modern import Modern, SilentUpstream
from tests.conftest import free_port, run_issuer
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession
from tests.test_durability import ROOT, mcp_tasks
from tests.test_upstreams import http_upstream, service, task_outcome, until

PROGRESS = b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{"progressToken":1,"progress":1}}\n\n'


async def test_callers_who_do_not_come_back_leave_no_connection_held_and_the_next_caller_gets_through(
    tmp_path: Path, database_url: str, http: httpx.AsyncClient
) -> None:
    """Each caller's idle session holds a connection to the upstream (the SDK's GET stream): they
    are kept for max_concurrency sessions in all, not per caller, so a stream of one-time callers
    never exhausts the upstream's connections (it did after a few, every call then waiting 30 s)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    async with run_issuer(LocalIssuer()) as issuer:
        with http_upstream(marks) as url:
            body = f'[[upstream]]\nname = "up"\nurl = "{url}"\nmax_concurrency = 1\n'
            async with service(tmp_path, database_url, body, auth="oauth", oauth_issuer=issuer.url) as server:
                for n in range(14):  # each one caller, once
                    token = issuer.mint(server.url, tenant_id="acme", sub=f"user-{n}")
                    s = RpcSession(http, server.url, token=token)
                    await s.initialize()
                    said = await asyncio.wait_for(
                        s.result("tools/call", {"name": "up.echo", "arguments": {"text": f"n{n}"}}), 20
                    )
                    assert said.get("isError") is not True, (n, said)
                    assert said["content"][0]["text"] == f"n{n}"


async def test_a_server_that_never_answers_initialize_is_stopped_with_the_attempt() -> None:
    """A stdio server that never answers: the failed connect ends its process (they piled up, one
    per try, each living a day)."""
    marker = f"never-answers-{uuid.uuid4().hex}"
    config = UpstreamConfig(name="mute", command=(sys.executable, "-c", "import time; time.sleep(600)", marker))
    for _ in range(2):
        with pytest.raises(ConnectFailed, match="no answer to initialize within 1 s"):
            await Connection(config, headers={}).open(timeout_s=1)

    def alive() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]

    for _ in range(100):
        if not alive():
            break
        await asyncio.sleep(0.1)
    left = alive()
    for p in left:
        p.kill()
    assert left == []


async def _streaming_upstream(writer_body: bytes) -> tuple[asyncio.Server, str]:
    """A raw HTTP server that answers every POST with an SSE stream of ``writer_body`` every 0.2 s
    and never with the answer."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(writer_body), writer_body))
                await writer.drain()
                await asyncio.sleep(0.2)
        except (ConnectionError, asyncio.CancelledError):
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/mcp"


@pytest.mark.parametrize(
    ("stream", "idle_s", "deadline_s"),
    [(PROGRESS, 30.0, 1.0), (b": keep-alive\n\n", 1.0, 60.0)],
    ids=["progress-past-the-deadline", "comments-past-idle"],
)
async def test_a_2026_answer_that_streams_forever_ends_at_its_deadline_or_idle_time(
    stream: bytes, idle_s: float, deadline_s: float
) -> None:
    """On 2026-07-28 timeout_s holds whatever the upstream streams, and only messages count as
    something sent: comments or empty events do not hold idle_timeout_s off."""
    srv, url = await _streaming_upstream(stream)

    async def no_headers() -> dict[str, str]:
        return {}

    notes: list[object] = []

    async def noted(message: object) -> None:
        notes.append(message)

    async with srv, httpx.AsyncClient() as client:
        modern = Modern(url, client, no_headers, 1 << 20)
        begun = time.monotonic()
        request = modern.request("tools/call", {"name": "x", "arguments": {}}, idle_s=idle_s,
                                 deadline=begun + deadline_s, on_notification=noted)  # fmt: skip
        with pytest.raises(SilentUpstream):
            await asyncio.wait_for(request, 20)  # (20 s: it streamed on)
    assert (len(notes) > 0) == (stream == PROGRESS)


async def test_a_bearer_file_that_is_not_text_is_a_credentials_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(UpstreamAuthError, match=f"auth.bearer_file {path} is not UTF-8 text"):
        await Credentials(Bearer(file=path)).headers()


async def test_cancelled_upstream_calls_log_no_error(
    tmp_path: Path, database_url: str, http: httpx.AsyncClient
) -> None:
    """A cancel closes the call's stream while the SDK client still reads it: it logged that at
    ERROR with a traceback (about every other cancel), which an alert on ERROR lines would page for."""
    marks = tmp_path / "marks"
    marks.mkdir()
    log = tmp_path / "serve.log"
    with http_upstream(marks) as url:
        body = f'[[upstream]]\nname = "up"\nurl = "{url}"\n'
        env = {"MCP_TASKS_UPSTREAMS_FILE": str(tmp_path / "upstreams.toml"), "MCP_TASKS_LOG_FORMAT": "json"}
        (tmp_path / "upstreams.toml").write_text(body)
        async with mcp_tasks("serve", database_url, log, **env) as (_proc, mcp):
            s = RpcSession(http, mcp)
            await s.initialize()
            await until(lambda: _listed(s, "up.sleep"))
            for n in range(10):
                task_id = (await s.call_tool_as_task("up.sleep", {"seconds": 2}))["task"]["taskId"]
                await until(lambda n=n: _started(marks, n + 1))
                await s.result("tasks/cancel", {"taskId": task_id})
                assert (await task_outcome(s, task_id))["status"] == "cancelled"
            await asyncio.sleep(1)  # the last cancel's stream closes
    lines = log.read_text().splitlines()
    assert not [line for line in lines if '"level":"error"' in line or "Traceback" in line], lines[-20:]


async def _listed(s: RpcSession, tool: str) -> bool:
    return tool in {t["name"] for t in (await s.result("tools/list"))["tools"]}


async def _started(marks: Path, n: int) -> bool:
    return len(list(marks.glob("sleep-*.started"))) >= n


async def test_an_http_upstream_killed_mid_call_fails_the_task_at_once_saying_so(
    tmp_path: Path, database_url: str, http: httpx.AsyncClient
) -> None:
    """The call's stream breaks off when the upstream dies: the task fails then, saying the
    upstream closed the connection, not after idle_timeout_s blaming its silence."""
    marks = tmp_path / "marks"
    marks.mkdir()
    port = free_port()
    argv = [sys.executable, "-m", "tests.upstream_server", "http", str(port), "--marks", str(marks)]
    upstream = subprocess.Popen(argv, cwd=ROOT)
    try:
        body = f'[[upstream]]\nname = "up"\nurl = "http://127.0.0.1:{port}/mcp"\nidle_timeout_s = 600\n'
        async with service(tmp_path, database_url, body) as server:
            s = RpcSession(http, server.url)
            await s.initialize()
            await until(lambda: _listed(s, "up.sleep"))
            task_id = (await s.call_tool_as_task("up.sleep", {"seconds": 60}))["task"]["taskId"]
            await until(lambda: _started(marks, 1))
            upstream.send_signal(signal.SIGKILL)
            failed = await task_outcome(s, task_id)  # (within until's 20 s: idle_timeout_s is 600)
            assert failed["status"] == "failed"
            assert "upstream 'up' (tool 'sleep') closed the connection during the call" in failed["statusMessage"]
    finally:
        upstream.kill()
        upstream.wait(10)
