"""Cross-replica signals for plain (non-task) requests: client answers and cancellations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.store.db import Database
from service.store.events import Event, EventHub


class Signals:
    def __init__(self, db: Database, hub: EventHub) -> None:
        self.db = db
        self.hub = hub

    def listen(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        """Call ``callback(kind, event)`` for every plain-request signal from any replica."""

        def on_event(event: Event) -> None:
            kind = event.get("k")
            if kind in ("rpc_response", "cancel_request"):
                callback(str(kind), event)

        self.hub.listeners.append(on_event)

    async def publish(self, kind: str, tenant_id: str, **fields: Any) -> None:
        await self.hub.publish(self.db.pool, {"k": kind, "t": tenant_id, **fields})
