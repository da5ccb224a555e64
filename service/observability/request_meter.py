"""Request counts and latencies, summed on the event loop and handed to prometheus-client in bulk."""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Final

from prometheus_client import Counter, Histogram

from service.observability import tracing
from service.observability.metric_labels import labelled

# Every request's count and latency go to prometheus-client at most this long after it ended, and
# at every scrape.
REQUEST_FLUSH_S: Final = 1.0


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class RequestMeter:
    """A request counter and latency histogram (``metrics.requests`` and ``metrics.request_seconds``)
    for every request, counted on the event loop's thread.

    prometheus-client takes a lock for each value it changes, three per request (the counter, the
    histogram's sum and its bucket): about 5 % of py-spy's samples of a plain call. Here a request adds to plain
    dictionaries, and the sums go to prometheus-client at every scrape (``exposition``), at most
    ``REQUEST_FLUSH_S`` after the request (so multiprocess mode's files, which another process
    scrapes, lag by no more), and when the process exits. Nothing is lost, nothing counted twice:
    the exposition is the one per-request ``inc`` and ``observe`` would have given."""

    def __init__(self, requests: Counter, seconds: Histogram, buckets: tuple[float, ...]) -> None:
        self._requests = requests
        self._seconds = seconds
        self._buckets = buckets  # the histogram's upper bounds, without +Inf
        self._counts: dict[tuple[str, str, str], int] = {}
        # Per method: one count per bucket and +Inf (not cumulative, as prometheus-client keeps
        # them), then the sum of the latencies.
        self._latency: dict[str, list[float]] = {}
        self._flush: asyncio.TimerHandle | None = None
        self._flush_loop: asyncio.AbstractEventLoop | None = None

    def record(self, method: str, outcome: str, wire: str, seconds: float) -> None:
        key = (method, outcome, wire)
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1
        if tracing.enabled() and (exemplar := tracing.exemplar()) is not None:
            # A sampled request's latency goes in at once, with its trace id as the bucket's exemplar.
            labelled(self._seconds, method).observe(seconds, exemplar=exemplar)
        else:
            row = self._latency.get(method)
            if row is None:
                row = self._latency[method] = [0.0] * (len(self._buckets) + 2)
            row[bisect_left(self._buckets, seconds)] += 1  # the first bound >= seconds (le)
            row[-1] += seconds
        if self._flush is None or self._flush_loop is not _running_loop():
            # (A timer of a loop since closed, as a test's, would never fire: set one on this loop.)
            self._schedule()

    def _schedule(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        loop = _running_loop()
        if loop is None:  # no event loop here: hand it over at once
            self.flush()
            return
        self._flush = loop.call_later(REQUEST_FLUSH_S, self.flush)
        self._flush_loop = loop

    def flush(self) -> None:
        """Hand what was counted since the last flush to prometheus-client."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        counts, self._counts = self._counts, {}
        latency, self._latency = self._latency, {}
        for (method, outcome, wire), n in counts.items():
            labelled(self._requests, method, outcome, wire).inc(n)
        for method, row in latency.items():
            child = labelled(self._seconds, method)
            # Histogram has no bulk observe: its per-bucket values and sum, as observe changes them.
            buckets = child._buckets
            for i, seen in enumerate(row[:-1]):
                if seen:
                    buckets[i].inc(seen)
            child._sum.inc(row[-1])


_waits: ContextVar[list[float] | None] = ContextVar("mcp_tasks_waits", default=None)


def track_waits() -> list[float]:
    """Start collecting this request's waits for tasks (see ``waiting_for_task``)."""
    acc: list[float] = []
    _waits.set(acc)
    return acc


@contextlib.contextmanager
def waiting_for_task() -> Iterator[None]:
    """Wrap a wait for a task to end (tasks/result) so the request's latency leaves it out."""
    started = time.perf_counter()
    try:
        yield
    finally:
        acc = _waits.get()
        if acc is not None:
            acc.append(time.perf_counter() - started)
