"""A run: its tool called (or the call already running awaited), then its outcome written.

``Runs`` holds the jobs of one runner's runs. The ledger decides which run starts and stops;
this carries it out, and tells the ledger when a run's tool ends and when the run is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from service.concurrency import eager
from service.domain.errors import Unavailable
from service.domain.task import FailureReason, Outcome, Task
from service.domain.values import frozen
from service.observability import logging as logctx
from service.observability import metrics, tracing
from service.runtime.commands import Run, TaskKey, key_of
from service.runtime.context import TaskRunContext, TaskSink
from service.runtime.executor import Executor
from service.runtime.fencing import LeaseTimes
from service.runtime.inline import InlineCall
from service.runtime.ledger import Ledger
from service.runtime.records import RunRecords
from service.store.events import EventHub
from service.store.runners import RunnerStore

log = logging.getLogger(__name__)


@frozen
class RunLimits:
    """How long a run may take (docs/decisions.md, "A runtime limit"): its tool, counted from the
    task's first start across takeovers (MCP_TASKS_MAX_RUNTIME_S: the default, and the ceiling of
    a tool's own), and each wait for an answer to a question (MCP_TASKS_INPUT_TIMEOUT_S)."""

    max_runtime_s: float = 86_400.0
    input_timeout_s: float = 3_600.0


# Tools that ignored their cancel at the runtime limit, left to end on their own (kept referenced).
_abandoned: set[asyncio.Future[Outcome]] = set()


def run_span(task: Task) -> contextlib.AbstractContextManager[Any]:
    """The run's span: a child of the request that created the task, in whichever process runs it."""
    if not tracing.enabled():
        return tracing.NO_SPAN

    def attributes() -> dict[str, Any]:  # read only for a span that may be recorded
        return {"gen_ai.tool.name": task.tool, "gen_ai.operation.name": "execute_tool", "mcp_tasks.wire": task.wire,
                tracing.TENANT_ATTRIBUTE: task.tenant_id, tracing.TASK_ATTRIBUTE: task.task_id[:8],
                "mcp_tasks.task.attempt": task.attempts}  # fmt: skip

    return tracing.run_span(task.trace_parent, f"execute_tool {task.tool}", attributes)


def over_limit(tool: str, limit_s: float) -> Outcome:
    return Outcome.failure(
        FailureReason.RUNTIME_LIMIT,
        f"The task ran longer than the runtime limit of tool {tool!r} ({limit_s:g} s, counted from its first "
        "start) and was stopped. Split the work into smaller calls, or ask the operator about the limit "
        "(MCP_TASKS_MAX_RUNTIME_S).",
    )


class Runs:
    """The jobs of one runner's runs, each under the runner's owner name."""

    def __init__(
        self, ledger: Ledger, executor: Executor, records: RunRecords, store: RunnerStore, hub: EventHub, *,
        owner: str, poll_s: float, times: LeaseTimes, settled: Callable[[], None], limits: RunLimits,
    ) -> None:  # fmt: skip
        """``settled``: called after each change of the ledger (the runner then claims if due)."""
        self.ledger = ledger
        self.executor = executor
        self.records = records
        self.store = store
        self.hub = hub
        self.owner = owner
        self.poll_s = poll_s
        self.times = times
        self.limits = limits
        self._settled = settled
        self.jobs: dict[TaskKey, tuple[Run, asyncio.Future[None]]] = {}  # each run and the job running it
        self.resumes: dict[TaskKey, asyncio.Future[None]] = {}  # answered runs waiting for a slot

    def sink(self, task: Task) -> TaskSink:
        return TaskSink(task, owner=self.owner, store=self.store, hub=self.hub, poll_s=self.poll_s,
                        input_timeout_s=self.limits.input_timeout_s, waits=_RunWaits(self, key_of(task)))  # fmt: skip

    def settled(self) -> None:
        self._settled()

    def wake_resumed(self) -> None:
        """Runs the ledger gave a slot back to, after their answer came, go on."""
        for run in self.ledger.take_resumed():
            if (resume := self.resumes.get(run.key)) is not None and not resume.done():
                resume.set_result(None)

    def launch(self, run: Run, call: InlineCall | None, capabilities: dict[str, Any] | None) -> None:
        """The run's first step is taken now (``eager``): a cancel can then only land inside
        ``_execute``, whose ``finally`` always hands the run's slot back."""
        job = eager.start(self._execute(run, call, capabilities), name=f"task-{run.task.task_id[:8]}")
        if not job.done():
            self.jobs[run.key] = (run, job)

    def cancel(self, run: Run) -> None:
        if (entry := self.jobs.get(run.key)) is not None and entry[0] is run:
            entry[1].cancel()

    def running(self) -> list[asyncio.Future[None]]:
        return [job for _run, job in self.jobs.values()]

    async def _execute(self, run: Run, call: InlineCall | None, capabilities: dict[str, Any] | None) -> None:
        """Run the task's tool (or await the call already running) and record its outcome. A
        session's task reads what its client declared from the session (not stored per task),
        unless the creating request handed it over (``capabilities``)."""
        task = run.task
        logctx.begin_run(tenant=task.tenant_id, subject=task.subject, tool=task.tool, task_id=task.task_id,
                         wire=task.wire)  # fmt: skip
        started = time.perf_counter()
        with run_span(task):
            try:
                caps = task.client_capabilities
                if call is None and task.session_id is not None and not caps:
                    if capabilities is None:
                        capabilities = await self._session_capabilities(task.tenant_id, task.session_id)
                    caps = capabilities
                self.ledger.tool_called(run)
                outcome = await self._call(task, call, caps)
                tracing.event("task.tool_ended", outcome=outcome.kind.value)
                if run.fenced:  # a tool that ignored its cancel: what it returned is not ours to write
                    raise asyncio.CancelledError
                self.ledger.tool_ended(run)
                self._settled()
                metrics.labelled(metrics.task_run_seconds, task.tool).observe(
                    time.perf_counter() - started, exemplar=tracing.exemplar()
                )
                await self.records.finish(task, outcome)
            except asyncio.CancelledError:
                back = self.ledger.run_cancelled(run, time.monotonic())
                tracing.event("task.handed_back" if back is not None else "task.cancelled")
                if back is not None:
                    await self.records.hand_back(back)
            except Exception:
                ref = secrets.token_hex(6)
                log.exception("runner failed to record the outcome of task %s (reference %s)", task.task_id[:8], ref)
                tracing.failed("unstorable")
                await self.records.unstorable(task, ref)
            finally:
                self._ended(run)

    async def _call(self, task: Task, call: InlineCall | None, caps: dict[str, Any]) -> Outcome:
        """The tool's outcome, or a failure once it runs past its runtime limit. The limit counts
        from the task's first start (a takeover does not restart it): when what is left runs out
        the tool is cancelled, and the task fails whether the tool then stops, returns anyway, or
        ignores the cancel for a renewal interval (it is then left to end on its own, its writes
        fenced off). A ledger's stop (cancel, fence, shutdown) waits for the tool to stop, then
        its rules apply. (Timers, not ``asyncio.timeout``: the first step runs before this run has
        a task of its own, see ``eager``.)"""
        spec = self.executor.registry.tools.get(task.tool)
        limit_s = spec.runtime_limit_s(self.limits.max_runtime_s) if spec is not None else self.limits.max_runtime_s
        left_s = limit_s - ((datetime.now(UTC) - task.started_at).total_seconds() if task.started_at else 0.0)
        ctx: TaskRunContext | None = None
        if call is not None:
            tool: asyncio.Future[Outcome] = call.job
        elif left_s <= 0:  # taken over past its limit: not started again
            return self._over_limit(task, limit_s)
        else:
            ctx = TaskRunContext(task, self.sink(task), caps)
            tool = eager.start(self.executor.run(task.tool, task.arguments, ctx), name=f"tool-{task.task_id[:8]}")
        if tool.done():
            return tool.result()
        loop = asyncio.get_running_loop()
        settled: asyncio.Future[None] = loop.create_future()
        expired = False
        handles: list[asyncio.TimerHandle] = []

        def settle(_: object = None) -> None:
            if not settled.done():
                settled.set_result(None)

        def expire() -> None:
            nonlocal expired
            if not tool.done():
                expired = True
                if ctx is not None:  # the task ends here: work it started elsewhere stops too
                    ctx.ending = True
                tool.cancel()
                handles.append(loop.call_later(self.times.renew_every, settle))  # how long it gets to stop

        tool.add_done_callback(settle)
        handles.append(loop.call_later(max(0.0, left_s), expire))
        try:
            await settled
        except asyncio.CancelledError:
            tool.cancel()
            await asyncio.wait([tool])
            raise
        finally:
            for handle in handles:
                handle.cancel()
            tool.remove_done_callback(settle)
        if not expired:
            return tool.result()
        if not tool.done():
            _abandoned.add(tool)
            tool.add_done_callback(_abandoned.discard)
            log.warning("tool %r of task %s ignored its cancel at the runtime limit: the task fails, the tool is "
                        "left to end on its own", task.tool, task.task_id[:8])  # fmt: skip
        return self._over_limit(task, limit_s)

    @staticmethod
    def _over_limit(task: Task, limit_s: float) -> Outcome:
        metrics.labelled(metrics.task_limit_failures, task.tool, "runtime").inc()
        log.warning("task %s of tool %r ran past its runtime limit of %g s: stopped, failed",
                    task.task_id[:8], task.tool, limit_s)  # fmt: skip
        return over_limit(task.tool, limit_s)

    def _ended(self, run: Run) -> None:
        if (entry := self.jobs.get(run.key)) is not None and entry[0] is run:
            del self.jobs[run.key]
        self.ledger.run_ended(run)
        self._settled()

    async def _session_capabilities(self, tenant_id: str, session_id: str) -> dict[str, Any]:
        """What the client of a task's session declared, read again while the database is away: a
        blip must not fail a task before its tool starts. For at most the fence time: the fence
        stops the run (cancelling this wait) if the database stays away; an error that outlasts it
        while the beats land is no blip, and fails the task."""
        delay = 0.25
        give_up = time.monotonic() + self.times.fence_after
        while True:
            try:
                return await self.store.session_capabilities(tenant_id, session_id)
            except Unavailable:
                if time.monotonic() + delay > give_up:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


class _RunWaits:
    """A run's wait for an answer, told to the ledger (``TaskSink.ask``): its slot goes back while
    it waits, and it goes on once it has one again."""

    def __init__(self, runs: Runs, key: TaskKey) -> None:
        self.runs = runs
        self.key = key

    def waiting(self) -> bool:
        run = self.runs.ledger.runs.get(self.key)
        if run is None:
            return False
        self.runs.ledger.run_waiting(run)
        self.runs.settled()
        return run.waiting

    async def resuming(self) -> None:
        run = self.runs.ledger.runs.get(self.key)
        if run is None or self.runs.ledger.run_resuming(run):
            self.runs.settled()
            return
        resume = asyncio.get_running_loop().create_future()
        self.runs.resumes[self.key] = resume
        try:
            await resume
        finally:
            if self.runs.resumes.get(self.key) is resume:
                del self.runs.resumes[self.key]
