"""The metrics an SRE relies on: their own port, real readiness, build info, no *_created series."""

from __future__ import annotations

import re

import pytest

from service import __version__
from service.observability.endpoint import MetricsEndpoint
from tests.conftest import free_port, http_client, make_settings, serve


async def test_serve_with_a_metrics_port_serves_metrics_only_there(database_url: str) -> None:
    port = free_port()
    async with serve(make_settings(database_url, metrics_port=port)) as running, http_client() as http:
        base = running.url.removesuffix("/mcp")
        assert (await http.get(base + "/metrics")).status_code == 404, "/metrics is not on the /mcp port"
        assert (await http.get(base + "/readyz")).status_code == 200
        side = f"http://127.0.0.1:{port}"
        scraped = await http.get(side + "/metrics")
        assert scraped.status_code == 200
        assert f'mcp_tasks_build_info{{component="serve",version="{__version__}"}} 1.0' in scraped.text
        assert not re.search(r"^\w+_created[{ ]", scraped.text, re.M), "no *_created series"
        assert 'mcp_tasks_db_pool_max{pool="app"}' in scraped.text
        assert 'mcp_tasks_db_up{pool="app"} 1.0' in scraped.text
        assert (await http.get(side + "/healthz")).json() == {"status": "ok"}
        ready = await http.get(side + "/readyz")
        assert ready.status_code == 200
        assert ready.json()["status"] == "ready"
        assert 'mcp_tasks_ready{check="readyz"} 1.0' in (await http.get(side + "/metrics")).text
        assert (await http.get(side + "/mcp")).status_code == 404
        assert (await http.post(side + "/metrics")).status_code == 405


async def test_metrics_port_reports_not_ready_when_readiness_fails() -> None:
    async def not_ready() -> tuple[int, dict[str, object]]:
        return 503, {"status": "database unreachable"}

    port = free_port()
    endpoint = MetricsEndpoint("127.0.0.1", port, not_ready)
    await endpoint.start()
    try:
        async with http_client() as http:
            r = await http.get(f"http://127.0.0.1:{port}/readyz")
            assert r.status_code == 503
            assert r.json() == {"status": "database unreachable"}
            assert (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
    finally:
        await endpoint.close()


@pytest.mark.parametrize("code", [-32602, -32029, 7])
def test_error_code_label_is_bounded(code: int) -> None:
    from service.observability.metrics import rpc_code

    assert rpc_code(code) == (str(code) if code < 0 else "other")


def test_a_metrics_port_equal_to_the_mcp_port_is_refused_naming_both() -> None:
    from pydantic import ValidationError

    from service.config import Settings

    with pytest.raises(ValidationError, match=r"MCP_TASKS_METRICS_PORT.*MCP_TASKS_PORT"):
        Settings(_env_file=None, port=8000, metrics_port=8000)  # type: ignore[call-arg]
