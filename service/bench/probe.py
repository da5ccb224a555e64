"""CPU seconds and RSS of a server's whole process tree (uvicorn workers, embedded PostgreSQL) via psutil."""

from __future__ import annotations

from typing import Any

import psutil  # type: ignore[import-untyped,unused-ignore]

MIB = 1024 * 1024


class ProbeError(Exception):
    """The server process cannot be observed (gone, or not ours to read)."""


class ServerProbe:
    """Samples one process and all its descendants; processes that come and go are tolerated."""

    def __init__(self, pid: int) -> None:
        try:
            self._root: Any = psutil.Process(pid)
            self._root.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied) as exc:
            raise ProbeError(f"cannot observe server process {pid}: {type(exc).__name__}") from None
        self.rss_peak = 0

    def _tree(self) -> list[Any]:
        try:
            return [self._root, *self._root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return [self._root]

    def cpu_seconds(self) -> float:
        """User + system time of every live process in the tree, plus what reaped children left behind.

        children_user/children_system only hold *reaped* children, which are no longer in the tree,
        so adding them for every process counts nothing twice.
        """
        total = 0.0
        for process in self._tree():
            try:
                t = process.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += float(t.user) + float(t.system) + float(t.children_user) + float(t.children_system)
        return total

    def rss_bytes(self) -> int:
        total = 0
        for process in self._tree():
            try:
                total += int(process.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.rss_peak = max(self.rss_peak, total)
        return total


class ServerWindow:
    """The probe's readings at the start and end of the measured phase."""

    def __init__(self, probe: ServerProbe) -> None:
        self._probe = probe
        self._cpu_start = probe.cpu_seconds()
        probe.rss_peak = 0
        self._rss_start = probe.rss_bytes()
        self._cpu_end = self._cpu_start
        self._rss_end = self._rss_start

    def sample(self) -> None:
        """Track the RSS peak, and CPU so far: if the server dies, its last reading still counts."""
        self._cpu_end = max(self._cpu_end, self._probe.cpu_seconds())
        self._probe.rss_bytes()

    def finish(self) -> None:
        self._cpu_end = max(self._cpu_end, self._probe.cpu_seconds())
        self._rss_end = self._probe.rss_bytes()

    def summary(self, ops: int, pending_created: int | None) -> dict[str, Any]:
        cpu_s = self._cpu_end - self._cpu_start
        growth: float | None = None
        if pending_created:
            growth = round((self._rss_end - self._rss_start) / 1024 / pending_created * 1000, 1)
        return {
            "cpu_s": round(cpu_s, 3),
            "cpu_ms_per_op": round(cpu_s * 1000 / ops, 4) if ops else None,
            "rss_start_mib": round(self._rss_start / MIB, 1),
            "rss_end_mib": round(self._rss_end / MIB, 1),
            "rss_peak_mib": round(self._probe.rss_peak / MIB, 1),
            "rss_growth_kib_per_1000_pending": growth,
            "pending_created": pending_created,
        }
