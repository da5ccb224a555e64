"""Settings refuse unsafe combinations (STYLE.md habit 6) and single-user mode stays on loopback."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import LOCAL_DEFAULT_TTL_MS, LOCAL_MAX_TTL_MS, Settings


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
