"""The wire-neutral core: events too large for NOTIFY travel by reference, answers apply by key
atomically, and one hand-back rule serves the reaper and a stopping runner."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from service.domain.errors import InvalidArguments
from service.domain.inputs import InputResponse
from service.domain.principal import LOCAL_PRINCIPAL, Caller
from service.store.db import APP_ROLE, Database
from service.store.events import MAX_INLINE, EventHub, PlainAnswer, decode, encode
from tests.conftest import make_settings, serve
from tests.rpc import RpcSession
from tests.test_durability import mcp_tasks


async def wait_status(s: RpcSession, task_id: str, status: str) -> dict[str, Any]:
    async with asyncio.timeout(20):
        while True:
            task = await s.result("tasks/get", {"taskId": task_id})
            if task["status"] == status:
                return task
            await asyncio.sleep(0.05)


def test_every_event_round_trips_through_its_versioned_payload() -> None:
    event = PlainAnswer("acme", "alice", "in-1", {"result": {"action": "accept"}})
    body = orjson.loads(encode(event))
    assert (body["v"], body["k"]) == (1, "plain_answer")
    assert decode(body) == event
    assert decode({**body, "v": 2}) is None  # a newer replica's event is ignored, not misread
    assert decode({"v": 1, "k": "no-such-kind"}) is None


async def test_an_event_too_large_for_notify_arrives_whole_by_reference(database_url: str) -> None:
    db = Database(database_url, pool_size=2, role=APP_ROLE)
    await db.open()
    hub = EventHub(db)
    await hub.start()
    try:
        big = {"result": {"action": "accept", "content": {"text": "x" * 20_000}}}
        event = PlainAnswer("acme", "alice", "in-big", big)
        assert len(encode(event)) > MAX_INLINE
        arrived: asyncio.Future[PlainAnswer] = asyncio.get_running_loop().create_future()
        hub.listeners.append(
            lambda e: arrived.set_result(e) if isinstance(e, PlainAnswer) and not arrived.done() else None
        )
        await hub.publish(event)
        assert await asyncio.wait_for(arrived, 10) == event
    finally:
        await hub.stop()
        await db.close()


@pytest.mark.slow
async def test_a_20kb_elicitation_answer_reaches_a_plain_call_on_another_process(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """The session and the answer go to one process, the plain call runs in another: the answer
    travels through PostgreSQL by reference and the call ends at once (it used to wait 600 s)."""
    async with serve(make_settings(database_url)) as here, mcp_tasks("serve", database_url) as (_proc, there_url):
        s = RpcSession(http, here.url)
        await s.initialize()
        there = RpcSession(http, there_url)
        there.session_id, there.version = s.session_id, s.version
        answer = {"action": "accept", "content": {"ok": True, "note": "y" * 20_000}}
        async with asyncio.timeout(30):
            final: dict[str, Any] = {}
            async for msg in there.stream("tools/call", {"name": "confirm", "arguments": {"prompt": "big?"}}):
                if msg.get("method") == "elicitation/create":
                    assert (await s.reply(msg["id"], answer)).status_code == 202  # to the other process
                elif "id" in msg and "method" not in msg:
                    final = msg
        assert final["result"]["content"][0]["text"].startswith("answer: note=yyyy")


async def test_answers_apply_by_key_all_or_nothing_and_the_first_answer_wins(
    database_url: str, http: httpx.AsyncClient
) -> None:
    """A task asking two questions at once: an update naming an unknown key and one valid answer
    applies that answer only; an invalid answer to the other applies nothing; a second answer to
    a key already answered changes nothing; the task works again when none is left."""
    async with serve(make_settings(database_url)) as running:
        s = RpcSession(http, running.url)
        await s.initialize()
        task_id = (await s.call_tool_as_task("ask_two", {}))["task"]["taskId"]
        await wait_status(s, task_id, "input_required")
        tasks = running.app.state.core.tasks
        caller = Caller(LOCAL_PRINCIPAL)
        async with asyncio.timeout(10):
            while len(pending := await tasks.store.pending_inputs(LOCAL_PRINCIPAL, task_id)) < 2:
                await asyncio.sleep(0.05)
        # The two questions were asked at once: either may have been stored first.
        by_message = {p.params["message"]: p.key for p in pending}
        first, second = by_message["first?"], by_message["second?"]
        accept = InputResponse(result={"action": "accept", "content": {"n": 1}})
        assert await tasks.answer(caller, task_id, {"never-issued": accept, first: accept})
        left = await tasks.store.pending_inputs(LOCAL_PRINCIPAL, task_id)
        assert [p.key for p in left] == [second]
        with pytest.raises(InvalidArguments):
            await tasks.answer(caller, task_id, {second: InputResponse(result={"action": "maybe"})})
        assert [p.key for p in await tasks.store.pending_inputs(LOCAL_PRINCIPAL, task_id)] == [second]
        late = InputResponse(result={"action": "decline"})
        assert not await tasks.answer(caller, task_id, {first: late})  # already answered: ignored
        assert await tasks.answer(
            caller, task_id, {second: InputResponse(result={"action": "accept", "content": {"n": 2}})}
        )
        done = await wait_status(s, task_id, "completed")
        assert done["status"] == "completed"
        result = await s.result("tasks/result", {"taskId": task_id})
        assert result["content"][0]["text"] == "accept:1 accept:2"
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                "SELECT outcome FROM audit_events WHERE action = 'input' AND task_id = $1 ORDER BY seq", task_id
            )
        finally:
            await conn.close()
        assert [r["outcome"] for r in rows] == ["accept", "accept"]  # one row per applied answer
