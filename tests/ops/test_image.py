"""The container image: Dockerfile lint and hygiene, the dependency lock, and its install steps for real."""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import asyncpg
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from tests.ops.conftest import ROOT, tool

DOCKERFILE = (ROOT / "Dockerfile").read_text()
LOCK = ROOT / "requirements.lock"
CI_USER = "mcp-tasks-ci"


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_dockerfile_passes_hadolint() -> None:
    done = subprocess.run([tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_pins_its_base_and_runs_serve_as_a_numeric_non_root_user() -> None:
    bases = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert len(bases) == 1
    assert re.search(r"-slim-[a-z]+@sha256:[0-9a-f]{64}$", bases[0])
    stages = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    assert stages == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"], "multi-stage, both on the pinned base"
    final = DOCKERFILE.split("\nFROM ")[-1]
    assert re.search(r"^USER 10001:10001$", final, re.M)
    assert 'ENTRYPOINT ["mcp-tasks"]' in final
    assert 'CMD ["serve"]' in final
    assert not re.search(r"^HEALTHCHECK", DOCKERFILE, re.M), "the chart's probes check health"
    assert not re.search(r"apt-get|gcc|build-essential", final), "no build tools in the final stage"


def test_lock_pins_every_runtime_dependency_within_its_range() -> None:
    pins = _lock_pins()
    env = default_environment()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for raw in deps:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} missing from requirements.lock: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside {req.specifier}: run `make lock`"
        )


def test_dockerfile_installs_the_lock_with_hashes_and_only_wheels() -> None:
    assert "--require-hashes --only-binary=:all: --no-deps -r requirements.lock" in DOCKERFILE
    assert "pip install --no-deps /wheels/*.whl" in DOCKERFILE


def _as_ci_user() -> tuple[int, int] | None:
    """Root (as in CI) runs the install as an unprivileged user, as the image does."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(CI_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", CI_USER], check=True)
        entry = pwd.getpwnam(CI_USER)
    return entry.pw_uid, entry.pw_gid


def _run(cmd: list[str], ids: tuple[int, int] | None, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=240,
        user=ids[0] if ids else None, group=ids[1] if ids else None, extra_groups=[] if ids else None,
    )  # fmt: skip
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_image_install_steps_work_as_a_non_root_user(admin_dsn: str) -> None:
    """The Dockerfile's steps without a daemon: wheel, locked install in a fresh venv, migrate, --help."""
    ids = _as_ci_user()
    with tempfile.TemporaryDirectory(prefix="mcp-tasks-image-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        src = work / "src"
        shutil.copytree(
            ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", "build", "dist")
        )
        if ids:
            for path in [work, *work.rglob("*")]:
                os.chown(path, *ids, follow_symlinks=False)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        venv = work / "venv"
        pip = [str(venv / "bin" / "pip"), "install", "--quiet"]
        # The unprivileged user cannot reach root's interpreter; the system one is as good for a venv.
        python = shutil.which("python3", path="/usr/bin") if ids else sys.executable
        assert python, "python3 in /usr/bin"
        _run([python, "-m", "venv", str(venv)], ids, env, src)
        _run([*pip, "--require-hashes", "--only-binary=:all:", "--no-deps", "-r", "requirements.lock"], ids, env, src)
        _run(
            [str(venv / "bin" / "pip"), "wheel", "--quiet", "--no-deps", "--wheel-dir", str(work / "wheels"), "."],
            ids,
            env,
            src,
        )
        wheels = list((work / "wheels").glob("*.whl"))
        assert len(wheels) == 1
        _run([*pip, "--no-deps", str(wheels[0])], ids, env, work)
        _run([str(venv / "bin" / "pip"), "check"], ids, env, work)
        assert "serve" in _run([str(venv / "bin" / "mcp-tasks"), "--help"], ids, env, work)

        name = f"mcp_tasks_ops_{secrets.token_hex(4)}"
        asyncio.run(_admin(admin_dsn, f'CREATE DATABASE "{name}"'))
        try:
            url = admin_dsn.rsplit("/", 1)[0] + "/" + name
            out = _run([str(venv / "bin" / "mcp-tasks"), "migrate"], ids, {**env, "MCP_TASKS_DATABASE_URL": url}, work)
            assert "(head)" in out
        finally:
            asyncio.run(_admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _admin(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
