"""Typed requests of the batched operations, one dataclass per operation (and SQL item type).

Each travels to PostgreSQL as one element of a jsonb array whose keys are the item type's fields
(``jsonb_populate_record``): a field added here is a field added to the SQL type, nowhere else.
A single request is a batch of one (one implementation per stored operation).
"""

from __future__ import annotations

from typing import Any

import orjson

from service.domain.principal import Caller, Principal
from service.domain.task import Outcome, OutcomeKind
from service.domain.values import frozen


@frozen
class CreateRequest:
    """An item of ``task_create`` (SQL type task_create_item)."""

    tenant_id: str
    task_id: str
    subject: str
    issuer: str
    client_id: str
    request_id: str | None
    client_address: str | None
    session_id: str | None
    wire: str
    tool: str
    arguments: dict[str, Any]
    client_capabilities: dict[str, Any]
    progress_token: str | int | None
    ttl_ms: int
    poll_interval_ms: int
    max_per_requestor: int
    max_per_tenant: int
    detail: dict[str, Any]
    rerunnable: bool
    tool_version: str | None
    lease_owner: str | None = None
    lease_ms: int | None = None
    # The tenant's storage quota in bytes (issue 42 §6); None: none.
    max_tenant_bytes: int | None = None
    # The creating request's W3C traceparent (tracing on, issue 44); None: not traced.
    trace_parent: str | None = None

    @property
    def order(self) -> tuple[str, str, str]:
        """Counters and rows are locked in (tenant, subject, task) order (see the schema)."""
        return (self.tenant_id, self.subject, self.task_id)

    @property
    def size_bytes(self) -> int:
        """About how many bytes the item carries: what group commit sizes its batches by."""
        return json_size(self.arguments) + json_size(self.client_capabilities)


@frozen
class Lease:
    """A slot of this process's runner: the task is created already leased to it."""

    owner: str
    ms: int


def create(
    caller: Caller,
    task_id: str,
    *,
    tool: str,
    arguments: dict[str, Any],
    wire: str,
    session_id: str | None,
    client_capabilities: dict[str, Any],
    progress_token: str | int | None,
    ttl_ms: int,
    poll_interval_ms: int,
    max_per_requestor: int,
    max_per_tenant: int,
    lease: Lease | None,
    rerunnable: bool,
    tool_version: str | None,
    origin: dict[str, str] | None = None,
    max_tenant_bytes: int | None = None,
    trace_parent: str | None = None,
) -> CreateRequest:
    """``rerunnable`` and ``tool_version``: the tool's, from this process's registry, recorded with
    the task so the reaper and the claims of other processes decide by them, not by their own packs.
    ``origin``: where the tool lives when not in a pack (an upstream), for the create's audit row."""
    p: Principal = caller.principal
    return CreateRequest(
        p.tenant_id, task_id, p.subject, p.issuer, p.client_id, caller.request_id, caller.address, session_id,
        wire, tool, arguments, client_capabilities, progress_token, ttl_ms, poll_interval_ms, max_per_requestor,
        max_per_tenant, {"tool": tool, "ttl_ms": ttl_ms, "wire": wire, **(origin or {})}, rerunnable, tool_version,
        lease.owner if lease else None, lease.ms if lease else None, max_tenant_bytes, trace_parent,
    )  # fmt: skip


@frozen
class GetRequest:
    """A get of ``task_get``: the requestor's unexpired task, read only."""

    tenant_id: str
    task_id: str
    subject: str

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.subject, self.task_id)

    @property
    def size_bytes(self) -> int:
        return 0


def get(caller: Caller, task_id: str) -> GetRequest:
    p = caller.principal
    return GetRequest(p.tenant_id, task_id, p.subject)


@frozen
class RetrieveRequest:
    """An item of ``task_retrieve`` (task_retrieve_item): a get whose hand-out of a finished
    task's result is audited (T-SEC-10), with the requestor and where its request came from."""

    tenant_id: str
    task_id: str
    subject: str
    issuer: str
    client_id: str
    request_id: str | None
    client_address: str | None

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.subject, self.task_id)

    @property
    def size_bytes(self) -> int:
        return 0


def retrieve(caller: Caller, task_id: str) -> RetrieveRequest:
    p = caller.principal
    return RetrieveRequest(p.tenant_id, task_id, p.subject, p.issuer, p.client_id, caller.request_id, caller.address)


@frozen
class FinishRequest:
    """An item of ``task_finish`` (task_finish_item): a runner's outcome, under its lease: it
    lands only while ``owner`` and ``epoch`` (the fencing token it was given) still hold it."""

    tenant_id: str
    task_id: str
    owner: str
    status: str
    outcome: str
    payload: dict[str, Any]
    status_message: str | None
    detail: dict[str, Any]
    epoch: int
    subject: str = ""  # orders the batch; not a field of the SQL type (ignored there)

    @classmethod
    def of(
        cls, tenant_id: str, task_id: str, subject: str, owner: str, outcome: Outcome, *, epoch: int
    ) -> FinishRequest:
        detail: dict[str, Any] = {"kind": outcome.kind.value}
        if outcome.kind is OutcomeKind.FAILURE:
            detail["reason"] = outcome.payload.get("reason")
        return cls(
            tenant_id,
            task_id,
            owner,
            outcome.status.value,
            outcome.kind.value,
            outcome.payload,
            outcome.status_message,
            detail,
            epoch,
            subject,
        )

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.subject, self.task_id)

    @property
    def size_bytes(self) -> int:
        return json_size(self.payload)


@frozen
class HandBackRequest:
    """An item of ``task_hand_back`` (task_hand_back_item): a runner gives a task back; it runs
    again if ``rerunnable`` and attempts remain, else it fails with ``failure``. Only while
    ``owner`` and ``epoch`` hold the lease; ``only_if_lapsed`` (the reaper): only once it lapsed."""

    tenant_id: str
    task_id: str
    owner: str
    rerunnable: bool
    max_attempts: int
    requeue_message: str
    failure: dict[str, Any]
    epoch: int
    subject: str = ""
    only_if_lapsed: bool = False

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.subject, self.task_id)


def json_size(value: Any) -> int:
    """The length of ``value`` as JSON; 0 for what JSON cannot carry (the statement refuses it)."""
    if not value:
        return 0
    try:
        return len(orjson.dumps(value))
    except TypeError:
        return 0


def as_items(requests: list[Any]) -> list[dict[str, Any]]:
    """The jsonb array a batch function takes (slots dataclasses: no deep copy on the hot path).
    Fields that are None are left out: ``jsonb_populate_record`` over NULL makes a missing key NULL."""
    return [{name: value for name in r.__slots__ if (value := getattr(r, name)) is not None} for r in requests]
