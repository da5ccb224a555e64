"""Typed requests of the batched operations, one dataclass per SQL item type of the schema.

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
class TaskRequest:
    """An item of ``task_batch`` (SQL type task_batch_item): a create, a get or a retrieve."""

    k: str
    tenant_id: str
    task_id: str
    subject: str
    issuer: str = ""
    client_id: str = ""
    request_id: str | None = None
    client_address: str | None = None
    session_id: str | None = None
    surface: str | None = None
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    client_capabilities: dict[str, Any] | None = None
    progress_token: str | int | None = None
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None
    max_per_requestor: int | None = None
    max_per_tenant: int | None = None
    detail: dict[str, Any] | None = None
    lease_owner: str | None = None
    lease_key: int | None = None
    lease_ms: int | None = None
    rerunnable: bool | None = None
    tool_version: str | None = None

    @property
    def order(self) -> tuple[str, str, str]:
        """Counters and rows are locked in (tenant, subject, task) order (see the schema)."""
        return (self.tenant_id, self.subject, self.task_id)

    @property
    def size_bytes(self) -> int:
        """About how many bytes the item carries: what group commit sizes its batches by."""
        return json_size(self.arguments) + json_size(self.client_capabilities)


def lookup(caller: Caller, task_id: str, *, retrieve: bool) -> TaskRequest:
    """The caller's unexpired task; ``retrieve`` audits the hand-out when it is terminal (T-SEC-10)."""
    p = caller.principal
    return TaskRequest(
        "retrieve" if retrieve else "get",
        p.tenant_id,
        task_id,
        p.subject,
        issuer=p.issuer,
        client_id=p.client_id,
        request_id=caller.request_id,
        client_address=caller.address,
    )


@frozen
class Lease:
    """A slot of this process's runner: create the task already leased to it."""

    owner: str
    key: int
    ms: int


def create(
    caller: Caller,
    task_id: str,
    *,
    tool: str,
    arguments: dict[str, Any],
    surface: str,
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
) -> TaskRequest:
    """``rerunnable`` and ``tool_version``: the tool's, from this process's registry, recorded with
    the task so the reaper and the claims of other processes decide by them, not by their own packs."""
    p: Principal = caller.principal
    return TaskRequest(
        "create",
        p.tenant_id,
        task_id,
        p.subject,
        issuer=p.issuer,
        client_id=p.client_id,
        request_id=caller.request_id,
        client_address=caller.address,
        session_id=session_id,
        surface=surface,
        tool=tool,
        arguments=arguments,
        client_capabilities=client_capabilities,
        progress_token=progress_token,
        ttl_ms=ttl_ms,
        poll_interval_ms=poll_interval_ms,
        max_per_requestor=max_per_requestor,
        max_per_tenant=max_per_tenant,
        detail={"tool": tool, "ttl_ms": ttl_ms, "surface": surface},
        lease_owner=lease.owner if lease else None,
        lease_key=lease.key if lease else None,
        lease_ms=lease.ms if lease else None,
        rerunnable=rerunnable,
        tool_version=tool_version,
    )


@frozen
class FinishRequest:
    """An item of ``task_finish_batch`` (task_finish_item): a runner's outcome, under its lease:
    it lands only while ``owner`` and ``epoch`` (the fencing token it was given) still hold it."""

    tenant_id: str
    task_id: str
    owner: str
    status: str
    outcome: str
    payload: dict[str, Any]
    status_message: str | None
    detail: dict[str, Any]
    subject: str = ""  # orders the batch; not a field of the SQL type (ignored there)
    epoch: int | None = None  # None: the owner alone decides (as a release before fencing did)

    @classmethod
    def of(
        cls, tenant_id: str, task_id: str, subject: str, owner: str, outcome: Outcome, *, epoch: int | None
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
            subject,
            epoch,
        )

    @property
    def order(self) -> tuple[str, str, str]:
        return (self.tenant_id, self.subject, self.task_id)

    @property
    def size_bytes(self) -> int:
        return json_size(self.payload)


@frozen
class ReleaseRequest:
    """An item of ``task_release_batch`` (task_release_item): a runner gives a task back; it runs
    again if ``rerunnable`` and attempts remain, else it fails with ``failure``. Only while
    ``owner`` and ``epoch`` hold the lease; ``only_if_lapsed`` (the reaper): only once its time ran out."""

    tenant_id: str
    task_id: str
    owner: str
    rerunnable: bool
    max_attempts: int
    requeue_message: str
    failure: dict[str, Any]
    subject: str = ""
    epoch: int | None = None
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
    Fields that are None are left out: ``jsonb_populate_record`` over NULL makes a missing key
    NULL, so a get (4 fields of 22 set) travels and parses as 4 keys, not 22."""
    return [{name: value for name in r.__slots__ if (value := getattr(r, name)) is not None} for r in requests]
