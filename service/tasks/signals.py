"""Cross-replica signals for plain (non-task) calls: client answers and cancellations."""

from __future__ import annotations

from collections.abc import Callable

from service.domain.inputs import InputResponse
from service.store.events import Event, EventHub, PlainAnswer, PlainCancel


class Signals:
    def __init__(self, hub: EventHub) -> None:
        self.hub = hub

    def listen(
        self,
        on_answer: Callable[[str, str, str, InputResponse], object],
        on_cancel: Callable[[str, str, str], object],
    ) -> None:
        """``on_answer(tenant, subject, key, response)`` and ``on_cancel(tenant, session, request)``
        for every plain-call signal from any replica."""

        def on_event(event: Event) -> None:
            if isinstance(event, PlainAnswer):
                on_answer(event.tenant_id, event.subject, event.key, InputResponse.from_stored(event.response))
            elif isinstance(event, PlainCancel):
                on_cancel(event.tenant_id, event.session_id, event.request)

        self.hub.listeners.append(on_event)

    async def answer(self, tenant_id: str, subject: str, key: str, response: InputResponse) -> None:
        await self.hub.publish(PlainAnswer(tenant_id, subject, key, response.to_stored()))

    async def cancel(self, tenant_id: str, session_id: str, request: str) -> None:
        await self.hub.publish(PlainCancel(tenant_id, session_id, request))
