"""An installed wheel, not only a checkout, carries the migrations: `mcp-tasks migrate` from it builds the schema."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import asyncpg
import pytest

from service.store import migrate
from tests.conftest import _with_db

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(*args: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, timeout=120, **kwargs)  # type: ignore[call-overload]


def _build_wheel(tmp: Path) -> Path:
    """Built from a copy of the sources, so the build leaves no build/ or egg-info in the checkout."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("service", "alembic"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", tmp / "dist", src)
    (wheel,) = (tmp / "dist").glob("*.whl")
    return wheel


def _expected_files() -> set[str]:
    """Every source and data file of service/, and alembic/ under service/_alembic/."""
    files = {p.relative_to(REPO).as_posix() for p in (REPO / "service").rglob("*") if p.is_file()}
    files |= {
        "service/_alembic/" + p.relative_to(REPO / "alembic").as_posix()
        for p in (REPO / "alembic").rglob("*")
        if p.is_file()
    }
    return {f for f in files if "__pycache__" not in f and not f.endswith(".pyc")}


async def test_a_wheel_installed_in_a_fresh_venv_migrates_an_empty_database(admin_dsn: str, tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    missing = _expected_files() - shipped
    assert not missing, f"not in the wheel (a package missing from [tool.setuptools] packages?): {sorted(missing)}"
    assert not any(name.startswith("alembic/") for name in shipped), "a top-level alembic/ would shadow the library"

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    _run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel)

    name = f"mcp_tasks_wheel_{secrets.token_hex(4)}"
    dsn = _with_db(admin_dsn, name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["MCP_TASKS_DATABASE_URL"] = dsn
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        where = _run(
            venv / "bin" / "python", "-c", "from service.store import migrate; print(migrate.script_location())",
            cwd=tmp_path, env=env,
        )  # fmt: skip
        assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
        first = _run(venv / "bin" / "mcp-tasks", "migrate", cwd=tmp_path, env=env)
        head = migrate.head_revision()
        assert first.stdout.strip() == f"database upgraded from an empty schema to {head} (head)"
        assert await migrate.current_revision(dsn) == head
        again = _run(venv / "bin" / "mcp-tasks", "migrate", cwd=tmp_path, env=env)
        assert again.stdout.strip() == f"database already at head ({head}); nothing to do"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
