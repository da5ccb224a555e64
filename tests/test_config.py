"""Settings refuse unsafe combinations (STYLE.md habit 6) and single-user mode stays on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.config import LOCAL_DEFAULT_TTL_MS, LOCAL_MAX_TTL_MS, Settings
from service.config_check import unknown_variables


def test_single_user_mode_refuses_a_public_bind() -> None:
    with pytest.raises(ValidationError, match="loopback"):
        Settings(auth="none", host="0.0.0.0")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_single_user_mode_accepts_loopback_binds(host: str) -> None:
    assert Settings(host=host).effective_auth == "none"


def test_auth_defaults_to_oauth_when_an_issuer_is_set() -> None:
    s = Settings(oauth_issuer="https://issuer.example", host="0.0.0.0")
    assert s.effective_auth == "oauth"
    assert s.effective_default_ttl_ms == 3_600_000
    assert s.effective_max_ttl_ms == 86_400_000


def test_single_user_mode_has_shorter_ttls() -> None:
    s = Settings()
    assert (s.effective_default_ttl_ms, s.effective_max_ttl_ms) == (LOCAL_DEFAULT_TTL_MS, LOCAL_MAX_TTL_MS)


def test_default_ttl_above_max_is_refused() -> None:
    with pytest.raises(ValidationError, match="exceeds"):
        Settings(default_ttl_ms=7_200_000, max_ttl_ms=3_600_000)


def test_oauth_without_issuer_is_refused() -> None:
    with pytest.raises(ValidationError, match="OAUTH_ISSUER"):
        Settings(auth="oauth")


def test_public_url_defaults_to_the_bind_address() -> None:
    assert Settings(port=9000).effective_public_url == "http://127.0.0.1:9000/mcp"


def test_environment_variables_use_the_mcp_tasks_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCP_TASKS_POLL_INTERVAL_MS", "250")
    assert Settings().poll_interval_ms == 250


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MCP_TASKS_")}
    return subprocess.run(
        [sys.executable, "-m", "service", *argv], capture_output=True, text=True, timeout=60, env={**environ, **env},
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip


def test_a_bad_setting_names_its_variable_and_the_allowed_values() -> None:
    done = run_cli("serve", MCP_TASKS_PORT="abc", MCP_TASKS_LOG_LEVEL="verbose")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "MCP_TASKS_PORT='abc'" in done.stderr
    assert "MCP_TASKS_LOG_LEVEL='VERBOSE'" in done.stderr
    assert "'DEBUG', 'INFO'" in done.stderr


def test_a_tool_pack_that_cannot_be_imported_is_a_message_not_a_traceback() -> None:
    done = run_cli("serve", MCP_TASKS_TOOLS="nosuchmod", MCP_TASKS_DATABASE_URL="postgresql://u@127.0.0.1:1/none")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "MCP_TASKS_TOOLS" in done.stderr
    assert "nosuchmod" in done.stderr


def test_a_misspelled_variable_is_reported_with_the_closest_name() -> None:
    assert unknown_variables({"MCP_TASKS_PROT": "1", "MCP_TASKS_PORT": "2", "HOME": "/"}) == [
        ("MCP_TASKS_PROT", "MCP_TASKS_PORT")
    ]
    done = run_cli("config", MCP_TASKS_PROT="1")
    assert "MCP_TASKS_PROT is not a setting" in done.stderr
    assert "did you mean MCP_TASKS_PORT" in done.stderr


def test_a_lower_max_ttl_lowers_the_default_it_did_not_set() -> None:
    s = Settings(max_ttl_ms=600_000)
    assert s.effective_default_ttl_ms == 600_000
    [note] = s.adjustments()
    assert "MCP_TASKS_DEFAULT_TTL_MS is not set" in note
    with pytest.raises(ValidationError, match="MCP_TASKS_DEFAULT_TTL_MS"):  # both set, inconsistently
        Settings(max_ttl_ms=600_000, default_ttl_ms=700_000)


def test_config_prints_the_effective_settings_with_secrets_masked() -> None:
    done = run_cli("config", MCP_TASKS_DATABASE_URL="postgresql://app:hunter2@db/tasks",
                   MCP_TASKS_OAUTH_CLIENT_SECRET="s3cret", MCP_TASKS_RATE_LIMIT_STORAGE="redis://:pw@r:6379")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hunter2" not in done.stdout
    assert "s3cret" not in done.stdout
    assert ":pw@" not in done.stdout
    assert 'MCP_TASKS_DATABASE_URL="postgresql://app:********@db/tasks"' in done.stdout
    assert "MCP_TASKS_PORT=8000" in done.stdout


def test_version() -> None:
    done = run_cli("--version")
    assert done.stdout.startswith("mcp-tasks ")


def test_near_misses_of_our_names_are_warnings_naming_the_intended_setting() -> None:
    """Issue 45, item 3: a wrong prefix, a misspelt name, or a bare DATABASE_URL while ours is unset."""
    found = dict(
        unknown_variables(
            {"MCP_TASK_DATABASE_URL": "x", "MCPTASKS_PORT": "1", "DATABASE_URL": "y", "MCP_SERVER": "z", "PATH": "/"}
        )
    )
    assert found == {
        "MCP_TASK_DATABASE_URL": "MCP_TASKS_DATABASE_URL",
        "MCPTASKS_PORT": "MCP_TASKS_PORT",
        "DATABASE_URL": "MCP_TASKS_DATABASE_URL",
    }
    assert unknown_variables({"DATABASE_URL": "y", "MCP_TASKS_DATABASE_URL": "z"}) == []  # ours is set: no doubt
    done = run_cli("config", MCP_TASK_DATABASE_URL="postgresql://u@db/x", DATABASE_URL="postgresql://u@db/y")
    warnings = [line for line in done.stderr.splitlines() if "MCP_TASKS_DATABASE_URL" in line]
    assert len(warnings) == 2, done.stderr
    assert done.returncode == 0


def test_config_shows_every_settings_value_in_force_and_where_it_came_from(tmp_path: Path) -> None:
    """Issue 45, item 3: default, environment or file, for every setting; a default left unset
    shows what it follows instead of a bare null."""
    env_file = tmp_path / "mcp-tasks.env"
    env_file.write_text("MCP_TASKS_POLL_INTERVAL_MS=250\nMCP_TASKS_PORT=1\nMCP_TASKS_OAUTH_CLIENT_SECRET=s3cret\n")
    done = run_cli("config", "--json", MCP_TASKS_ENV_FILE=str(env_file), MCP_TASKS_PORT="9001")
    assert done.returncode == 0, done.stderr
    rows = {row["variable"]: row for row in map(json.loads, done.stdout.splitlines())}
    assert set(rows) == {f"MCP_TASKS_{name.upper()}" for name in Settings.model_fields}
    assert (rows["MCP_TASKS_PORT"]["value"], rows["MCP_TASKS_PORT"]["source"]) == (9001, "environment")
    assert (rows["MCP_TASKS_POLL_INTERVAL_MS"]["value"], rows["MCP_TASKS_POLL_INTERVAL_MS"]["source"]) == (250, "file")
    assert rows["MCP_TASKS_OAUTH_CLIENT_SECRET"]["value"] == "********"
    assert rows["MCP_TASKS_HOST"]["source"] == "default"
    for name in ("MCP_TASKS_AUTH", "MCP_TASKS_PUBLIC_URL", "MCP_TASKS_DEFAULT_TTL_MS", "MCP_TASKS_MAX_TTL_MS",
                 "MCP_TASKS_OAUTH_AUDIENCE", "MCP_TASKS_RUNNER_TENANT_SHARE"):  # fmt: skip
        assert rows[name]["value"] is not None, name
    unset = [row for row in rows.values() if row["value"] is None]
    assert all(row["note"] for row in unset), unset  # what an unset one means, e.g. the embedded database


def test_the_embedded_database_of_a_checkout_lives_in_its_own_git_ignored_directory() -> None:
    """Issue 45, item 3: `make run` in two clones never shares a database or a dev issuer key."""
    from service.config import default_data_dir, source_checkout

    checkout = source_checkout()
    assert checkout == Path(__file__).resolve().parents[1]
    data_dir = default_data_dir()
    assert data_dir == checkout / ".data" or checkout.name not in str(data_dir)  # as root under /root: per checkout
    ignored = subprocess.run(["git", "check-ignore", "-q", str(checkout / ".data" / "pgdata")], cwd=checkout)
    assert ignored.returncode == 0
