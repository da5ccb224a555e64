"""The dev issuer's configuration, its persisted signing key, and RFC 9068 access-token minting."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from joserfc import jwt
from joserfc.jwk import ECKey, KeyParameters

log = logging.getLogger(__name__)

TENANT_CLAIM: Final = "tenant_id"


@dataclass(frozen=True)
class DevIssuerConfig:
    issuer: str
    audience: str
    key_path: Path | None
    token_ttl_s: int = 3600
    default_tenant: str = "dev-tenant"
    default_subject: str = "dev-user"
    scopes_supported: tuple[str, ...] = ("tasks",)


def load_or_create_signing_key(path: Path | None) -> ECKey:
    """The P-256 signing key stored at `path` (JWK JSON, mode 0600), generated there on first use."""
    params: KeyParameters = {"alg": "ES256", "use": "sig"}
    if path is None:
        return ECKey.generate_key("P-256", parameters=params, auto_kid=True)
    if not path.exists():
        _write_new_key(path, ECKey.generate_key("P-256", parameters=params, auto_kid=True))
    if path.stat().st_mode & 0o077:
        log.warning("dev issuer signing key %s is readable by other users; chmod 600 it", path)
    try:
        key = ECKey.import_key(json.loads(path.read_text()))
    except ValueError as exc:
        raise ValueError(f"{path} does not hold a JWK: {exc}") from exc
    if key.curve_name != "P-256" or not key.is_private:
        raise ValueError(f"{path} does not hold a private P-256 key")
    return ECKey.import_key(key.as_dict(private=True), parameters={**params, "kid": key.thumbprint()})


def _write_new_key(path: Path, key: ECKey) -> None:
    # Written to a private temp file, then hard-linked into place: a concurrent reader never sees a
    # half-written key, and a concurrent creator's key is never overwritten (the link just fails).
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(key.as_dict(private=True), out)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
            log.info("dev issuer generated a signing key at %s", path)
    finally:
        tmp.unlink()


def mint_access_token(
    key: ECKey,
    config: DevIssuerConfig,
    *,
    tenant: str,
    subject: str,
    client_id: str,
    scope: str,
    audience: str,
    ttl_s: int | None = None,
) -> str:
    """An RFC 9068 JWT access token signed with `key`."""
    now = int(time.time())
    claims = {
        "iss": config.issuer,
        "sub": subject,
        "aud": audience,
        "iat": now,
        "nbf": now,
        "exp": now + (config.token_ttl_s if ttl_s is None else ttl_s),
        "jti": secrets.token_urlsafe(16),
        "client_id": client_id,
        "scope": scope,
        TENANT_CLAIM: tenant,
    }
    return jwt.encode({"alg": "ES256", "typ": "at+jwt", "kid": key.kid}, claims, key)
