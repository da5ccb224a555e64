"""A test OAuth issuer: RFC 8414 metadata, a real JWKS over HTTP, introspection, and a token minter
that can also make every kind of bad token. Keys are generated at test time, never stored."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from joserfc import jwt
from joserfc.jwk import ECKey, RSAKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class LocalIssuer:
    url: str = ""
    keys: list[ECKey | RSAKey] = field(default_factory=list)
    delay_s: float = 0.0
    down: bool = False
    jwks_fetches: int = 0
    active_opaque: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.keys:
            self.keys.append(ECKey.generate_key("P-256", parameters={"kid": "key-1", "alg": "ES256"}))

    def rotate(self) -> ECKey:
        key = ECKey.generate_key("P-256", parameters={"kid": f"key-{len(self.keys) + 1}", "alg": "ES256"})
        self.keys.append(key)
        return key

    def claims(self, audience: str, **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.url,
            "sub": "alice",
            "aud": audience,
            "tenant_id": "acme",
            "client_id": "test-client",
            "scope": "tasks",
            "iat": now,
            "nbf": now,
            "exp": now + 600,
            "jti": uuid.uuid4().hex,
        }
        claims.update(overrides)
        return {k: v for k, v in claims.items() if v is not None}

    def mint(
        self, audience: str, *, key: ECKey | RSAKey | None = None, header: dict[str, Any] | None = None, **claims: Any
    ) -> str:
        key = key or self.keys[0]
        alg = "RS256" if isinstance(key, RSAKey) else "ES256"
        hdr = {"alg": alg, "typ": "at+jwt", "kid": key.kid, **(header or {})}
        return jwt.encode(hdr, self.claims(audience, **claims), key)

    def app(self) -> Starlette:
        async def metadata(request: Request) -> Response:
            if self.down:
                return Response(status_code=500)
            return JSONResponse(
                {"issuer": self.url, "jwks_uri": f"{self.url}/jwks", "token_endpoint": f"{self.url}/token"}
            )

        async def jwks(request: Request) -> Response:
            self.jwks_fetches += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.down:
                return Response(status_code=503)
            return JSONResponse({"keys": [k.as_dict(private=False) for k in self.keys]})

        async def introspect(request: Request) -> Response:
            form = await request.form()
            claims = self.active_opaque.get(str(form.get("token")))
            return JSONResponse({"active": True, **claims} if claims else {"active": False})

        return Starlette(
            routes=[
                Route("/.well-known/oauth-authorization-server", metadata),
                Route("/jwks", jwks),
                Route("/introspect", introspect, methods=["POST"]),
            ]
        )


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def unsigned(header: dict[str, Any], claims: dict[str, Any], signature: bytes = b"") -> str:
    """A hand-built JWT (for alg=none and other forgeries the JOSE library refuses to make)."""
    return f"{b64(orjson.dumps(header))}.{b64(orjson.dumps(claims))}.{b64(signature)}"
