"""asyncio helpers that know nothing of the service: a coroutine's first step taken at once, loops stopped for good."""
