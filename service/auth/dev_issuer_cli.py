"""What the `mcp-tasks` CLI runs for the dev issuer: serve it, or fetch a token from a running one."""

from __future__ import annotations

from pathlib import Path

import httpx
import uvicorn

from service.auth.dev_issuer import create_dev_issuer_app
from service.auth.dev_issuer_records import DEV_CLIENT_ID, DEV_CLIENT_SECRET
from service.auth.dev_keys import DevIssuerConfig
from service.config import is_loopback_host

NOT_RUNNING = "is the dev issuer running? start it with `mcp-tasks dev-issuer`"


def issuer_url(host: str, port: int) -> str:
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{bracketed}:{port}"


def run_dev_issuer(host: str, port: int, audience: str, key_path: Path | None) -> None:
    """Serve the development-only issuer until Ctrl-C; refuses anything but a loopback bind."""
    if not is_loopback_host(host):
        # It hands a token for any tenant to anyone who asks: never let it be reachable from elsewhere.
        raise SystemExit(f"mcp-tasks dev-issuer: refusing to bind {host}; use a loopback address such as 127.0.0.1")
    if not 0 < port < 65536:
        raise SystemExit(f"mcp-tasks dev-issuer: the port must be 1-65535 (the issuer URL names it), not {port}")
    issuer = issuer_url(host, port)
    try:
        app = create_dev_issuer_app(DevIssuerConfig(issuer=issuer, audience=audience, key_path=key_path))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"mcp-tasks dev-issuer: {exc}") from exc
    print(f"Development OAuth issuer (NEVER use in production): {issuer}")
    print(f"Signing key: {key_path if key_path else 'in memory (tokens stop verifying after a restart)'}")
    print("Point the service at it with:")
    print(f"  MCP_TASKS_OAUTH_ISSUER={issuer}")
    print(f"  MCP_TASKS_OAUTH_AUDIENCE={audience}")
    print(f"Tokens: client_credentials at {issuer}/token as client {DEV_CLIENT_ID!r}, secret 'dev'", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False, ws="none")


def request_token(issuer: str, *, tenant: str, subject: str, scope: str, resource: str | None) -> str:
    """An access token from the running dev issuer, by client_credentials as the built-in `dev` client."""
    form = {"grant_type": "client_credentials", "tenant": tenant, "subject": subject, "scope": scope}
    if resource:
        form["resource"] = resource
    url = f"{issuer.rstrip('/')}/token"
    try:
        response = httpx.post(url, data=form, auth=(DEV_CLIENT_ID, DEV_CLIENT_SECRET), timeout=10.0)
    except httpx.TransportError as exc:
        raise SystemExit(f"cannot reach {url} ({type(exc).__name__}): {NOT_RUNNING}") from exc
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise SystemExit(f"{url} answered HTTP {response.status_code} without JSON: {NOT_RUNNING}")
    if response.status_code != 200 or not isinstance(body.get("access_token"), str):
        problem = f"{body.get('error', 'no access_token')}: {body.get('error_description', '')}".rstrip(": ")
        raise SystemExit(
            f"the dev issuer at {issuer} refused the token request (HTTP {response.status_code}, {problem})"
        )
    token: str = body["access_token"]
    return token
