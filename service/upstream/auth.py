"""The credentials this service presents to an upstream: its own, never the caller's (the MCP
authorization spec forbids token pass-through). A bearer from the environment or a file, or an
OAuth 2.0 client-credentials token (authlib's client), cached until shortly before it expires."""

from __future__ import annotations

import asyncio
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.upstream.config import Bearer, ClientCredentials

# A token is fetched again this long before it expires (a call may take a while to reach the server).
REFRESH_EARLY_S = 60.0
TOKEN_TIMEOUT_S = 10.0


class UpstreamAuthError(Exception):
    """Our credentials for an upstream could not be had: the message says what to fix."""


class Credentials:
    """The Authorization header for one upstream's requests, if it has auth."""

    def __init__(self, auth: Bearer | ClientCredentials | None, environ: Mapping[str, str] | None = None) -> None:
        self.auth = auth
        self._env = os.environ if environ is None else environ
        self._token: str | None = None
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def headers(self) -> dict[str, str]:
        token = await self.token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def token(self) -> str | None:
        auth = self.auth
        if auth is None:
            return None
        if isinstance(auth, Bearer):
            return await self._bearer(auth)
        async with self._lock:
            if self._token is None or time.monotonic() >= self._expires:
                self._token, self._expires = await self._fetch(auth)
            return self._token

    def forget(self) -> None:
        """The upstream refused the token (401): fetch a new one next time."""
        self._token = None

    async def _bearer(self, auth: Bearer) -> str:
        if auth.env is not None:
            value = self._env.get(auth.env, "")
            if not value:
                raise UpstreamAuthError(f"the environment variable {auth.env} (auth.bearer_env) is empty")
            return value
        assert auth.file is not None
        try:
            value = (await asyncio.to_thread(Path(auth.file).read_text, encoding="utf-8")).strip()
        except OSError as exc:
            raise UpstreamAuthError(f"cannot read auth.bearer_file {auth.file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise UpstreamAuthError(f"auth.bearer_file {auth.file} is not UTF-8 text") from None
        if not value:
            raise UpstreamAuthError(f"auth.bearer_file {auth.file} is empty")
        return value

    async def _fetch(self, auth: ClientCredentials) -> tuple[str, float]:
        with warnings.catch_warnings():  # authlib 1.7 calls its httpx client deprecated; it works as before
            warnings.simplefilter("ignore")
            from authlib.integrations.httpx_client import AsyncOAuth2Client

        secret = self._env.get(auth.client_secret_env, "")
        client = AsyncOAuth2Client(client_id=auth.client_id, client_secret=secret, scope=auth.scope,
                                   timeout=TOKEN_TIMEOUT_S)  # fmt: skip
        try:
            token: dict[str, Any] = await client.fetch_token(auth.token_url, grant_type="client_credentials")
        except Exception as exc:  # the token endpoint's refusal or an unreachable endpoint, said in one line
            raise UpstreamAuthError(f"no token from {auth.token_url} (client_credentials): {_short(exc)}") from None
        finally:
            await client.aclose()
        access = token.get("access_token")
        if not isinstance(access, str) or not access:
            raise UpstreamAuthError(f"the token endpoint {auth.token_url} answered without an access_token")
        expires_in = token.get("expires_in")
        lifetime = float(expires_in) if isinstance(expires_in, int | float) and expires_in > 0 else 300.0
        return access, time.monotonic() + max(1.0, lifetime - min(REFRESH_EARLY_S, lifetime / 2))


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
