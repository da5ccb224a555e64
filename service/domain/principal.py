"""Who is calling: taken from a verified token (or the fixed local principal in single-user mode)."""

from __future__ import annotations

from dataclasses import field

from service.domain.values import frozen

# The audit chain of denials made before any tenant is known; no token may name this tenant.
RESERVED_TENANT = "-"


@frozen
class Principal:
    """A task belongs to (tenant_id, subject); issuer and client id are recorded for audit."""

    tenant_id: str
    subject: str
    issuer: str = ""
    client_id: str = ""
    scopes: frozenset[str] = field(default_factory=frozenset)
    # When the credential that named this principal runs out (epoch seconds; None: never).
    expires_at: float | None = None

    @property
    def owner_key(self) -> tuple[str, str]:
        return (self.tenant_id, self.subject)


LOCAL_PRINCIPAL = Principal(tenant_id="local", subject="local", issuer="local", client_id="local")


@frozen
class Caller:
    """A principal in one request: what the audit trail records besides the change itself."""

    principal: Principal
    request_id: str | None = None
    address: str | None = None
