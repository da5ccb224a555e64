"""Issue 42 §1: no tenant, however many subjects it has, can take more than its share of what a
process holds in flight (requests, tasks/result streams, subscriptions, GET streams), so another
tenant is never answered 503; one principal's open tasks/result requests are capped too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from service.client import sse_messages
from tests.conftest import RunningServer, http_client, make_settings, run_issuer, serve
from tests.ext import V2026Client
from tests.issuer import LocalIssuer
from tests.rpc import RpcSession

TOTAL = 20  # MCP_TASKS_MAX_CONCURRENT_REQUESTS of these tests: a tenant's default share is half


@contextlib.asynccontextmanager
async def hosted(database_url: str, **overrides: Any) -> AsyncIterator[tuple[RunningServer, LocalIssuer]]:
    async with run_issuer(LocalIssuer()) as issuer:
        settings = make_settings(database_url, auth="oauth", oauth_issuer=issuer.url,
                                 max_concurrent_requests=TOTAL, **overrides)  # fmt: skip
        async with serve(settings) as server:
            yield server, issuer


async def session(
    http: httpx.AsyncClient, server: RunningServer, issuer: LocalIssuer, tenant: str, sub: str
) -> RpcSession:
    s = RpcSession(http, server.url, token=issuer.mint(server.url, tenant_id=tenant, sub=sub))
    await s.initialize()
    return s


class Holder:
    """Requests held open (each a task that opens its stream, reports its status, and waits)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.statuses: list[int] = []
        self.jobs: list[asyncio.Task[None]] = []

    def hold(self, http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        async def held() -> None:
            async with http.stream("POST", url, content=orjson.dumps(body), headers=headers) as r:
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    await self.release.wait()

        self.jobs.append(asyncio.create_task(held()))

    async def settled(self, n: int) -> None:
        async with asyncio.timeout(20):
            while len(self.statuses) < n:
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.release.set()
        for job in self.jobs:
            job.cancel()
        await asyncio.gather(*self.jobs, return_exceptions=True)


async def test_one_token_holding_result_streams_takes_only_its_share_and_its_own_cap(database_url: str) -> None:
    """The attack: one token held 600 tasks/result streams on one sleep task, and every other tenant
    got 503. Now the principal may hold MCP_TASKS_MAX_RESULT_STREAMS_PER_PRINCIPAL (here 6) and
    its tenant MCP_TASKS_REQUEST_TENANT_SHARE (half of TOTAL); beyond either, 429 + Retry-After."""
    async with hosted(database_url, max_result_streams_per_principal=6) as (server, issuer), \
            http_client(max_connections=200) as http:  # fmt: skip
        flood = [await session(http, server, issuer, "tenant-a", f"s{i}") for i in range(3)]
        victim = await session(http, server, issuer, "tenant-b", "bob")
        task_id = (await flood[0].call_tool_as_task("sleep", {"seconds": 60}))["task"]["taskId"]
        holder = Holder()
        try:
            for _ in range(7):  # one principal: 6 held, the 7th refused by its own cap
                holder.hold(http, server.url, flood[0].message("tasks/result", {"taskId": task_id}), flood[0].headers())
            await holder.settled(7)
            assert sorted(holder.statuses) == [200] * 6 + [429]
            # Two more subjects of the same tenant: together at most its share (TOTAL / 2 = 10).
            for s in flood[1:]:
                other = (await s.call_tool_as_task("sleep", {"seconds": 60}))["task"]["taskId"]
                for _ in range(6):
                    holder.hold(http, server.url, s.message("tasks/result", {"taskId": other}), s.headers())
            await holder.settled(19)
            assert holder.statuses.count(200) == TOTAL // 2
            refused = await http.post(server.url, json=flood[1].message("tools/list"), headers=flood[1].headers())
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert "MCP_TASKS_REQUEST_TENANT_SHARE" in refused.json()["error"]["message"]
            # The other tenant is served, never 503.
            for _ in range(5):
                assert (await victim.result("tools/list"))["tools"]
            echoed = (await victim.call_tool_as_task("echo", {"text": "served"}))["task"]["taskId"]
            assert (await victim.result("tasks/result", {"taskId": echoed}))["content"][0]["text"] == "served"
        finally:
            await holder.close()
        # Released: the tenant is served again (once the server has seen the streams close).
        async with asyncio.timeout(10):
            while "result" not in await flood[1].send("tools/list"):
                await asyncio.sleep(0.1)


async def test_many_subjects_listening_take_only_their_tenants_share(database_url: str) -> None:
    """The attack: 33 subjects of one tenant x 16 subscriptions/listen made every other tenant get
    503. Their listens (and GET streams) together hold at most the tenant's share."""
    async with hosted(database_url) as (server, issuer), http_client(max_connections=200) as http:
        holder = Holder()
        try:
            for i in range(4):  # 4 subjects x 4 listens = 16 > the share of 10
                token = issuer.mint(server.url, tenant_id="tenant-a", sub=f"s{i}")
                c = V2026Client(http, server.url, token=token)
                for _ in range(4):
                    body = c.body("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
                    holder.hold(http, server.url, body, c.headers("subscriptions/listen"))
            await holder.settled(16)
            assert holder.statuses.count(200) == TOTAL // 2
            assert holder.statuses.count(429) == 16 - TOTAL // 2
            victim = V2026Client(http, server.url, token=issuer.mint(server.url, tenant_id="tenant-b", sub="bob"))
            assert (await victim.result("tools/list"))["tools"]
            body = victim.body("subscriptions/listen", {"notifications": {}})
            async with http.stream("POST", server.url, content=orjson.dumps(body),
                                   headers=victim.headers("subscriptions/listen")) as r:  # fmt: skip
                assert r.status_code == 200
                ack = await anext(sse_messages(r))
                assert ack["method"] == "notifications/subscriptions/acknowledged"
        finally:
            await holder.close()
