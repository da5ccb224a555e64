"""Access-token verification (RFC 9068 JWTs via the issuer's JWKS, or RFC 7662 introspection).

    AuthFailure (auth/base.py)
    ├── 401 invalid_token           bad signature, claims, issuer, audience, expiry, unknown key
    └── 503 temporarily_unavailable the issuer's metadata or JWKS cannot be fetched and none is cached

Keys are found by RFC 8414 (then OpenID) discovery, cached for ``MCP_TASKS_OAUTH_JWKS_CACHE_S``,
and refetched at most every ``MCP_TASKS_OAUTH_JWKS_MIN_REFRESH_S`` when a token names an unknown ``kid``
(or after a failed fetch). Every fetch
has a short timeout, so a slow issuer costs a bounded wait, never a hung request.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from service.config import Settings
from service.domain.principal import RESERVED_TENANT, Principal
from service.observability import tracing

log = logging.getLogger(__name__)

# Asymmetric algorithms only: "none" and HMAC (which a public key could forge) are refused.
ALLOWED_ALGS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"})
# RFC 9068 says at+jwt; many identity providers send JWT or nothing (docs/decisions.md A-3).
ALLOWED_TYP = frozenset({"at+jwt", "application/at+jwt", "jwt"})

CACHE_SIZE = 10_000
INTROSPECTION_CACHE_S = 30.0


class TokenRejected(Exception):
    """The token is not acceptable; ``reason`` is a short bounded label for logs and metrics,
    ``detail`` what the audit row of the denial records besides it."""

    def __init__(self, reason: str, description: str, **detail: str) -> None:
        super().__init__(description)
        self.reason = reason
        self.description = description
        self.detail = detail


class IssuerUnavailable(Exception):
    """The issuer's metadata or keys cannot be fetched right now."""


# Longer tenants or subjects would overflow an index row (about 2.7 KB) and serve no one.
MAX_IDENTITY_CHARS = 256


def normalize_uri(uri: str) -> str:
    """A-AUD-4: compare resource identifiers with case-insensitive scheme and host, no trailing slash."""
    parts = urlsplit(uri.strip())
    if parts.fragment or "#" in uri:
        return uri  # a resource identifier has no fragment (RFC 8707): it matches nothing
    if not parts.scheme or not parts.netloc:
        return uri.strip().rstrip("/")
    path = parts.path.rstrip("/")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{path}" + (f"?{parts.query}" if parts.query else "")


def fingerprint(token: str) -> str:
    """A log-safe handle for a token: never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def _b64json(segment: str) -> dict[str, Any]:
    try:
        value = orjson.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (ValueError, orjson.JSONDecodeError):
        raise TokenRejected("malformed", "the token is not a well-formed JWT") from None
    if not isinstance(value, dict):
        raise TokenRejected("malformed", "the token is not a well-formed JWT")
    return value


@dataclass
class _IssuerKeys:
    keys: KeySet | None = None
    fetched_at: float = 0.0
    jwks_uri: str | None = None
    last_kid_refresh: float = float("-inf")
    failed_at: float = float("-inf")  # a failed fetch is not retried by every request for a while


class TokenVerifier:
    def __init__(self, settings: Settings, http: httpx.AsyncClient) -> None:
        self.settings = settings
        self.http = http
        self.issuers = settings.trusted_issuers
        self.audience = normalize_uri(settings.effective_audience)
        self._keys: dict[str, _IssuerKeys] = {i: _IssuerKeys() for i in self.issuers}
        self._locks: dict[str, asyncio.Lock] = {i: asyncio.Lock() for i in self.issuers}
        self._verified: OrderedDict[bytes, tuple[Principal, float]] = OrderedDict()
        # MCP_TASKS_OAUTH_ISSUER_TENANTS: the tenants each issuer may name (empty: one issuer, any tenant).
        self._tenants = {issuer: _tenant_pattern(p) for issuer, p in settings.issuer_tenants.items()}

    def cached(self, token: str) -> Principal | None:
        """The principal of a token verified before and still unexpired (no I/O, no signature check)."""
        cache_key = hashlib.sha256(token.encode()).digest()
        cached = self._verified.get(cache_key)
        if cached is None or cached[1] <= time.time():
            return None
        self._verified.move_to_end(cache_key)
        return cached[0]

    async def verify(self, token: str) -> Principal:
        if (principal := self.cached(token)) is not None:
            return principal
        cache_key = hashlib.sha256(token.encode()).digest()
        try:
            if token.count(".") == 2:
                principal, expires = await self._verify_jwt(token)
            elif self.settings.oauth_introspection_url:
                principal, expires = await self._introspect(token)
            else:
                raise TokenRejected(
                    "malformed", "the access token is not a JWT and no introspection endpoint is configured"
                )
        except (TokenRejected, IssuerUnavailable):
            raise
        except Exception:  # any shape we did not foresee is the token's fault, never a crash
            log.warning("token rejected as malformed", exc_info=True)
            raise TokenRejected("malformed", "the token is not a well-formed access token") from None
        principal = dataclasses.replace(principal, expires_at=expires)
        self._verified[cache_key] = (principal, expires)
        if len(self._verified) > CACHE_SIZE:
            self._verified.popitem(last=False)
        return principal

    # --- JWT -----------------------------------------------------------------------------------

    async def _verify_jwt(self, token: str) -> tuple[Principal, float]:
        header_b64, payload_b64, _sig = token.split(".")
        header = _b64json(header_b64)
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in ALLOWED_ALGS:
            raise TokenRejected(
                "algorithm", f"tokens signed with {alg!r} are not accepted; use an asymmetric algorithm"
            )
        typ = header.get("typ")
        if typ is not None and (not isinstance(typ, str) or typ.lower() not in ALLOWED_TYP):
            raise TokenRejected("type", f"token type {typ!r} is not an access token")
        issuer = _b64json(payload_b64).get("iss")
        if not isinstance(issuer, str) or issuer.rstrip("/") not in self._keys:
            raise TokenRejected("issuer", "the token's issuer is not trusted by this server")
        issuer = issuer.rstrip("/")
        keys = await self._keyset(issuer, kid=header.get("kid"))
        try:
            decoded = jwt.decode(token, keys, algorithms=[str(alg)])
        except (JoseError, ValueError) as exc:
            raise TokenRejected("signature", f"the token's signature does not verify ({type(exc).__name__})") from None
        return self._principal_from_claims(decoded.claims, issuer)

    def _principal_from_claims(self, claims: dict[str, Any], issuer: str) -> tuple[Principal, float]:
        now = time.time()
        leeway = self.settings.oauth_leeway_s
        exp = claims.get("exp")
        if not isinstance(exp, int | float) or isinstance(exp, bool):
            raise TokenRejected("claims", "the token has no expiry (exp)")
        if now > exp + leeway:
            raise TokenRejected("expired", "the token has expired")
        nbf, iat = claims.get("nbf"), claims.get("iat")
        for name, value in (("nbf", nbf), ("iat", iat)):
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
                raise TokenRejected("claims", f"the token's {name} is not a number")
        if nbf is not None and now < nbf - leeway:
            raise TokenRejected("not_yet_valid", "the token is not valid yet (nbf)")
        if iat is not None and iat > now + leeway:
            raise TokenRejected("not_yet_valid", "the token was issued in the future (iat)")
        aud = claims.get("aud")
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if not any(isinstance(a, str) and normalize_uri(a) == self.audience for a in audiences):
            raise TokenRejected("audience", f"the token is not for this server: aud must contain {self.audience}")
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise TokenRejected("claims", "the token has no subject (sub)")
        tenant = claims.get(self.settings.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise TokenRejected("claims", f"the token has no tenant claim ({self.settings.tenant_claim})")
        for name, value in (("sub", subject), (self.settings.tenant_claim, tenant)):
            # Identities are keys of rows, indexes and log lines: bounded, and free of control
            # characters (a NUL cannot be stored; a newline would forge a log line).
            if len(value) > MAX_IDENTITY_CHARS or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
                raise TokenRejected(
                    "claims",
                    f"the token's {name} must be at most {MAX_IDENTITY_CHARS} characters, none a control character",
                )
        client_claim = claims.get("client_id", claims.get("azp"))
        if isinstance(client_claim, str) and (
            len(client_claim) > MAX_IDENTITY_CHARS or any(ord(c) < 0x20 for c in client_claim)
        ):
            raise TokenRejected("claims", f"the token's client_id must be at most {MAX_IDENTITY_CHARS} characters")
        if tenant == RESERVED_TENANT:
            raise TokenRejected("claims", f"tenant {RESERVED_TENANT!r} is reserved (unauthenticated audit events)")
        subject = self._subject_key(issuer, tenant, subject)
        client_id = claims.get("client_id", claims.get("azp", ""))
        scopes = claims.get("scope", claims.get("scp", ""))
        if isinstance(scopes, str):
            scope_set = frozenset(scopes.split())
        elif isinstance(scopes, list) and all(isinstance(x, str) for x in scopes):
            scope_set = frozenset(scopes)
        else:
            raise TokenRejected("claims", "the token's scope is neither a string nor a list of strings")
        principal = Principal(
            tenant_id=tenant,
            subject=subject,
            issuer=issuer,
            client_id=client_id if isinstance(client_id, str) else "",
            scopes=scope_set,
        )
        return principal, float(exp)

    def _subject_key(self, issuer: str, tenant: str, sub: str) -> str:
        """The stored subject of ``sub`` from ``issuer`` in ``tenant``, after checking the issuer may
        speak for the tenant. Of the issuers that may speak for a tenant, the first listed in
        MCP_TASKS_OAUTH_ISSUER keeps the plain ``sub`` (so the rows of a single-issuer deployment
        stay its own when an issuer is added); the others' subjects are ``<issuer>#<sub>``, which
        no other issuer can produce (an issuer has no '#'; the first one's ``sub`` may not start so)."""
        if not self._tenants:
            return sub
        speakers = [i for i in self.issuers if (p := self._tenants.get(i)) is not None and p.fullmatch(tenant)]
        if issuer not in speakers:
            raise TokenRejected(
                "tenant_not_allowed",
                "the token's issuer may not speak for the tenant it names (MCP_TASKS_OAUTH_ISSUER_TENANTS)",
                issuer=issuer,
                tenant=tenant,
            )
        if issuer != speakers[0]:
            return f"{issuer}#{sub}"
        if any(sub.startswith(f"{other}#") for other in speakers[1:]):
            raise TokenRejected("claims", "the token's sub has the form of another issuer's qualified subject")
        return sub

    async def _keyset(self, issuer: str, *, kid: Any) -> KeySet:
        state = self._keys[issuer]
        now = time.monotonic()
        fresh = state.keys is not None and now - state.fetched_at < self.settings.oauth_jwks_cache_s
        if fresh and (kid is None or _has_kid(state.keys, kid)):
            assert state.keys is not None
            return state.keys
        async with self._locks[issuer]:
            state = self._keys[issuer]
            fresh = state.keys is not None and time.monotonic() - state.fetched_at < self.settings.oauth_jwks_cache_s
            if fresh and (kid is None or _has_kid(state.keys, kid)):
                assert state.keys is not None
                return state.keys
            # An unknown kid refetches, but at most every MCP_TASKS_OAUTH_JWKS_MIN_REFRESH_S (junk tokens cannot
            # make us hammer the issuer); after a failed fetch, requests use what is cached (or fail fast)
            # until that interval passes, so a slow issuer cannot pile requests up behind the lock.
            kid_refresh = fresh and time.monotonic() - state.last_kid_refresh >= self.settings.oauth_jwks_min_refresh_s
            recently_failed = time.monotonic() - state.failed_at < self.settings.oauth_jwks_min_refresh_s
            if (state.keys is None or not fresh or kid_refresh) and not recently_failed:
                if kid_refresh:
                    state.last_kid_refresh = time.monotonic()
                try:
                    state.keys = await self._fetch_jwks(issuer, state)
                    state.fetched_at = time.monotonic()
                except IssuerUnavailable:
                    state.failed_at = time.monotonic()
                    if state.keys is None:
                        raise
                    log.warning("keeping cached JWKS of %s: refresh failed", issuer)
        if state.keys is None:
            raise IssuerUnavailable(issuer)
        if kid is not None and not _has_kid(state.keys, kid):
            raise TokenRejected("unknown_key", "the token was signed by a key the issuer does not publish")
        return state.keys

    async def _fetch_jwks(self, issuer: str, state: _IssuerKeys) -> KeySet:
        if state.jwks_uri is None:
            state.jwks_uri = self.settings.oauth_jwks_url or await self._discover_jwks_uri(issuer)
        data = await self._get_json(state.jwks_uri)
        try:
            return KeySet.import_key_set(data)  # type: ignore[arg-type]
        except (JoseError, ValueError, TypeError, KeyError) as exc:
            raise IssuerUnavailable(f"the JWKS at {state.jwks_uri} is not a valid key set: {exc}") from None

    async def _discover_jwks_uri(self, issuer: str) -> str:
        """RFC 8414 (path-inserted, then root) and OpenID discovery, in that order."""
        parts = urlsplit(issuer)
        base = f"{parts.scheme}://{parts.netloc}"
        path = parts.path.rstrip("/")
        candidates = [
            f"{base}/.well-known/oauth-authorization-server{path}",
            f"{issuer}/.well-known/openid-configuration",
            f"{base}/.well-known/openid-configuration{path}",
        ]
        for url in dict.fromkeys(candidates):
            try:
                metadata = await self._get_json(url)
            except IssuerUnavailable:
                continue
            if str(metadata.get("issuer", "")).rstrip("/") == issuer and isinstance(metadata.get("jwks_uri"), str):
                return str(metadata["jwks_uri"])
        raise IssuerUnavailable(f"no authorization server metadata with a jwks_uri found for {issuer}")

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            with tracing.client_span("GET", {"http.request.method": "GET", "url.full": url}):
                headers: dict[str, str] = {}
                tracing.inject(headers)
                response = await self.http.get(url, timeout=self.settings.oauth_http_timeout_s, headers=headers)
        except httpx.HTTPError as exc:
            raise IssuerUnavailable(f"{url}: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise IssuerUnavailable(f"{url}: HTTP {response.status_code}")
        try:
            data = response.json()
        except ValueError:
            raise IssuerUnavailable(f"{url}: not JSON") from None
        if not isinstance(data, dict):
            raise IssuerUnavailable(f"{url}: not a JSON object")
        return data

    # --- RFC 7662 introspection ---------------------------------------------------------------

    async def _introspect(self, token: str) -> tuple[Principal, float]:
        url = self.settings.oauth_introspection_url
        assert url is not None
        auth: httpx.Auth | httpx.USE_CLIENT_DEFAULT = httpx.USE_CLIENT_DEFAULT  # type: ignore[valid-type]
        if self.settings.oauth_client_id:
            auth = httpx.BasicAuth(self.settings.oauth_client_id, self.settings.oauth_client_secret or "")
        try:
            with tracing.client_span("POST", {"http.request.method": "POST", "url.full": url}):
                headers: dict[str, str] = {}
                tracing.inject(headers)
                response = await self.http.post(
                    url,
                    data={"token": token, "token_type_hint": "access_token"},
                    auth=auth,
                    timeout=self.settings.oauth_http_timeout_s,
                    headers=headers,
                )
            data = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            raise IssuerUnavailable(f"{url}: introspection failed") from None
        if not isinstance(data, dict):
            raise IssuerUnavailable(f"{url}: introspection answered HTTP {response.status_code}")
        if data.get("active") is not True:
            raise TokenRejected("inactive", "the token is not active")
        token_type = data.get("token_type")
        if token_type is not None and str(token_type).lower() not in ("access_token", "bearer"):
            raise TokenRejected("type", "the introspected token is not an access token")
        iss = data.get("iss")
        if iss is None and len(self.issuers) == 1:
            iss = self.issuers[0]
        if not isinstance(iss, str) or iss.rstrip("/") not in self._keys:
            raise TokenRejected("issuer", "the introspected token names no trusted issuer")
        issuer = iss.rstrip("/")
        principal, exp = self._principal_from_claims(data, issuer)
        return principal, min(exp, time.time() + INTROSPECTION_CACHE_S)


def _tenant_pattern(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regular expression for tenant names and patterns, in which '*' matches any run of characters."""
    return re.compile("|".join(".*".join(re.escape(part) for part in p.split("*")) for p in patterns), re.DOTALL)


def _has_kid(keys: KeySet | None, kid: Any) -> bool:
    return keys is not None and any(k.kid == kid for k in keys.keys)
