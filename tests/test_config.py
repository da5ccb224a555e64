"""Settings refuse unsafe combinations (STYLE.md habit 6) and single-user mode stays on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.config import LOCAL_DEFAULT_TTL_MS, LOCAL_MAX_TTL_MS, Settings, unknown_variables


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
