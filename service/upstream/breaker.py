"""A circuit breaker per upstream: after ``threshold`` calls in a row fail because of the upstream
(unreachable, closed the connection, silent past its idle timeout, garbage), calls are refused at
once for ``open_s`` instead of holding runner slots; then one call is let through, and its outcome
closes the circuit or opens it again.

Written here rather than taken from a library: the async breakers on PyPI (aiobreaker, pybreaker's
async mode) wrap the call and count every exception, and ours must count only the failures that
are the upstream's (a tool error it answered with, or our own cancel, is not one), and show its
state to the CLI and the metrics: the state machine is the 40 lines below.
"""

from __future__ import annotations

import time
from typing import Literal

State = Literal["closed", "open", "half_open"]


class Breaker:
    def __init__(self, *, threshold: int = 5, open_s: float = 30.0) -> None:
        self.threshold = threshold
        self.open_s = open_s
        self.failures = 0
        self.opened_at: float | None = None
        self.trial = False  # a call is let through while half-open
        self.last_error: str | None = None

    def state(self) -> State:
        if self.opened_at is None:
            return "closed"
        return "open" if time.monotonic() - self.opened_at < self.open_s else "half_open"

    def refuses(self) -> float | None:
        """Seconds until calls are tried again, when this call must be refused now."""
        state = self.state()
        if state == "closed":
            return None
        if state == "open":
            assert self.opened_at is not None
            return self.opened_at + self.open_s - time.monotonic()
        if self.trial:  # half-open: one trial at a time
            return 1.0
        self.trial = True
        return None

    def failed(self, error: str) -> None:
        self.last_error = error
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.threshold:
            self.opened_at = time.monotonic()
        self.trial = False

    def succeeded(self) -> None:
        self.failures, self.opened_at, self.trial = 0, None, False

    def settled(self) -> None:
        """A call ended that says nothing of the upstream: a trial may be made again."""
        self.trial = False
