"""The upstreams file (MCP_TASKS_UPSTREAMS_FILE): one ``[[upstream]]`` table per MCP server whose
tools this service runs as tasks. Read and checked once, at start: a mistake stops the start with
one line naming the upstream and the key (``UpstreamConfigError``). Nothing here talks to a server."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from service.domain.values import frozen

TaskSupport = Literal["forbidden", "optional", "required"]
NAME: Final = re.compile(r"[a-z0-9-]+")
# The upstream's part of a tool's name, `<upstream>.<tool>`; the tool's own name is the server's.
SEPARATOR: Final = "."
TOP_KEYS: Final = frozenset({"upstream"})
KEYS: Final = frozenset(
    {"name", "url", "command", "env", "cwd", "tools", "exclude", "task_support", "rerunnable", "timeout_s",
     "idle_timeout_s", "max_concurrency", "circuit_failures", "circuit_open_s", "auth", "forward"}
)  # fmt: skip
AUTH_KEYS: Final = frozenset({"bearer_env", "bearer_file", "client_credentials"})
CLIENT_CREDENTIALS_KEYS: Final = frozenset({"token_url", "client_id", "client_secret_env", "scope"})
FORWARD_KEYS: Final = frozenset({"tenant_header", "subject_header"})
VISIBLE: Final = frozenset(chr(c) for c in range(0x20, 0x7F))
HEADER: Final = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token (RFC 9110)
RESERVED_HEADERS: Final = frozenset(
    {"authorization", "content-type", "accept", "host", "content-length", "mcp-session-id", "mcp-protocol-version",
     "last-event-id", "connection", "transfer-encoding"}
)  # fmt: skip


class UpstreamConfigError(ValueError):
    """The file cannot be used: the message names the file, the upstream and the key."""


@frozen
class Bearer:
    """A static token: the value of an environment variable or the contents of a file (read at each
    connection, so a rotated file is picked up)."""

    env: str | None = None
    file: Path | None = None


@frozen
class ClientCredentials:
    token_url: str
    client_id: str
    client_secret_env: str
    scope: str | None = None


@frozen
class Forward:
    tenant_header: str | None = None
    subject_header: str | None = None

    def headers(self, caller: tuple[str, str] | None) -> dict[str, str]:
        """The headers that tell the upstream who calls (``caller``: tenant and subject)."""
        if caller is None:
            return {}
        pairs = ((self.tenant_header, caller[0]), (self.subject_header, caller[1]))
        return {header: header_value(value) for header, value in pairs if header}


def header_value(value: str) -> str:
    """A tenant or subject as a header value: as is when it is visible ASCII, else percent-encoded
    UTF-8 (docs/decisions.md, "Telling an upstream who calls")."""
    return value if VISIBLE.issuperset(value) else quote(value, safe="")


@frozen
class UpstreamConfig:
    name: str
    url: str | None = None
    command: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    tools: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    task_support: TaskSupport = "optional"
    rerunnable: bool = False
    timeout_s: float = 3_600.0
    idle_timeout_s: float = 300.0
    max_concurrency: int = 16
    # The breaker opens after this many calls in a row fail because of the upstream, for circuit_open_s.
    circuit_failures: int = 5
    circuit_open_s: float = 30.0
    auth: Bearer | ClientCredentials | None = None
    forward: Forward = field(default_factory=Forward)

    @property
    def transport(self) -> Literal["http", "stdio"]:
        return "http" if self.url else "stdio"

    @property
    def prefix(self) -> str:
        return self.name + SEPARATOR

    def exposes(self, tool: str) -> bool:
        """Whether the upstream's tool of that name is one of ours (``tools`` and ``exclude``)."""
        return ("*" in self.tools or tool in self.tools) and tool not in self.exclude

    def describe(self) -> dict[str, Any]:
        """What ``mcp-tasks config`` shows: every setting, secrets by where they come from only."""
        out: dict[str, Any] = {"name": self.name, "transport": self.transport}
        if self.url:
            out["url"] = safe_url(self.url)
        else:
            out["command"] = list(self.command)
            if self.env:
                out["env"] = {k: "****" for k in self.env}
            if self.cwd:
                out["cwd"] = str(self.cwd)
        out |= {
            "tools": list(self.tools), "exclude": list(self.exclude), "task_support": self.task_support,
            "rerunnable": self.rerunnable, "timeout_s": self.timeout_s, "idle_timeout_s": self.idle_timeout_s,
            "max_concurrency": self.max_concurrency, "circuit_failures": self.circuit_failures,
            "circuit_open_s": self.circuit_open_s,
        }  # fmt: skip
        if isinstance(self.auth, Bearer):
            out["auth"] = f"bearer from ${self.auth.env}" if self.auth.env else f"bearer from file {self.auth.file}"
        elif isinstance(self.auth, ClientCredentials):
            out["auth"] = (
                f"client_credentials at {self.auth.token_url} as {self.auth.client_id} "
                f"(secret from ${self.auth.client_secret_env})"
            )
        headers = [h for h in (self.forward.tenant_header, self.forward.subject_header) if h]
        if headers:
            out["forward"] = headers
        return out


def safe_url(url: str) -> str:
    """A URL as it may be shown (logs, failure messages, ``mcp-tasks config``): without a password
    in it, and its query's values hidden (a token may ride there)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:****@{host}" if ":" in user else netloc
    query = "&".join(f"{k}=****" for k, _v in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def load(path: str | Path, *, environ: Mapping[str, str] | None = None) -> list[UpstreamConfig]:
    """The file's upstreams, checked; secrets are checked to exist, not read into the result."""
    env = os.environ if environ is None else environ
    where = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UpstreamConfigError(f"{where}: no such file (MCP_TASKS_UPSTREAMS_FILE)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UpstreamConfigError(f"{where}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UpstreamConfigError(f"{where}: not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise UpstreamConfigError(f"{where}: unknown key {unknown[0]!r} (each server is an [[upstream]] table)")
    tables = raw.get("upstream", [])
    if not isinstance(tables, list):
        raise UpstreamConfigError(f"{where}: 'upstream' must be an array of tables ([[upstream]])")
    out: list[UpstreamConfig] = []
    for i, table in enumerate(tables):
        upstream = _upstream(table, f"{where}: upstream #{i + 1}", env)
        if any(u.name == upstream.name for u in out):
            raise UpstreamConfigError(f"{where}: upstream {upstream.name!r}: name: two upstreams have this name")
        out.append(upstream)
    return out


def check_no_clash(upstreams: Iterable[UpstreamConfig], pack_tools: Iterable[str]) -> None:
    """An upstream's tools are `<name>.<tool>`: no tool of a pack may live in that space."""
    tools = sorted(pack_tools)
    for upstream in upstreams:
        for tool in tools:
            if tool.startswith(upstream.prefix):
                raise UpstreamConfigError(
                    f"upstream {upstream.name!r}: name: the tool pack tool {tool!r} is in this upstream's "
                    f"names ({upstream.prefix}*); rename the upstream"
                )


class _Table:
    """Typed reads of one table's keys, each mistake one line naming the upstream and the key."""

    def __init__(self, table: dict[str, Any], where: str) -> None:
        self.table = table
        self.where = where

    def fail(self, key: str, problem: str) -> UpstreamConfigError:
        return UpstreamConfigError(f"{self.where}: {key}: {problem}")

    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self.table.get(key)
        if value is None:
            if required:
                raise self.fail(key, "missing")
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(key, "must be a non-empty string")
        return value

    def strings(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.table.get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.fail(key, "must be a list of non-empty strings")
        return tuple(value)

    def number(self, key: str, default: float, *, low: float, high: float) -> float:
        value = self.table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
            raise self.fail(key, f"must be a number above {low:g} and at most {high:g}")
        return float(value)

    def whole(self, key: str, default: int) -> int:
        value = self.table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 10_000:
            raise self.fail(key, "must be a whole number from 1 to 10000")
        return value

    def keys(self, allowed: frozenset[str], what: str) -> None:
        unknown = sorted(set(self.table) - allowed)
        if unknown:
            raise self.fail(unknown[0], f"unknown key in {what} (known: {', '.join(sorted(allowed))})")


def _upstream(table: Any, where: str, env: Mapping[str, str]) -> UpstreamConfig:
    if not isinstance(table, dict):
        raise UpstreamConfigError(f"{where}: must be a table")
    t = _Table(table, where)
    name = t.string("name", required=True)
    assert name is not None
    if not NAME.fullmatch(name):
        raise t.fail("name", f"{name!r} must match [a-z0-9-]+")
    t.where = f"{where.rsplit(': ', 1)[0]}: upstream {name!r}"
    t.keys(KEYS, "[[upstream]]")
    url, command = t.string("url"), t.strings("command", ())
    if bool(url) == bool(command):
        raise t.fail("url", "give exactly one of url (Streamable HTTP) and command (stdio)")
    if url and not re.match(r"https?://[^/\s]+", url):
        raise t.fail("url", f"{url!r} is not an http:// or https:// URL")
    env_table = table.get("env", {})
    if not isinstance(env_table, dict) or not all(isinstance(v, str) for v in env_table.values()):
        raise t.fail("env", "must be a table of strings")
    if url and (env_table or "cwd" in table):
        raise t.fail("env" if env_table else "cwd", "applies to a stdio upstream (command) only")
    cwd = t.string("cwd")
    if cwd is not None and not Path(cwd).is_dir():
        raise t.fail("cwd", f"{cwd!r} is not a directory")
    support = table.get("task_support", "optional")
    if support not in ("forbidden", "optional", "required"):
        raise t.fail("task_support", "must be forbidden, optional or required")
    rerunnable = table.get("rerunnable", False)
    if not isinstance(rerunnable, bool):
        raise t.fail("rerunnable", "must be true or false")
    concurrency = t.whole("max_concurrency", 16)
    failures = t.whole("circuit_failures", 5)
    return UpstreamConfig(
        name=name, url=url, command=command, env=dict(env_table), cwd=Path(cwd) if cwd else None,
        tools=t.strings("tools", ("*",)), exclude=t.strings("exclude", ()), task_support=support,
        rerunnable=rerunnable, timeout_s=t.number("timeout_s", 3_600, low=0, high=31_536_000),
        idle_timeout_s=t.number("idle_timeout_s", 300, low=0, high=31_536_000), max_concurrency=concurrency,
        circuit_failures=failures, circuit_open_s=t.number("circuit_open_s", 30, low=0, high=86_400),
        auth=_auth(table.get("auth"), t.where, env), forward=_forward(table.get("forward"), t.where, url),
    )  # fmt: skip


def _auth(value: Any, where: str, env: Mapping[str, str]) -> Bearer | ClientCredentials | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UpstreamConfigError(f"{where}: auth: must be a table ([upstream.auth])")
    t = _Table(value, where)
    t.keys(AUTH_KEYS, "[upstream.auth]")
    if len(value) != 1:
        raise t.fail("auth", "give exactly one of bearer_env, bearer_file and client_credentials")
    if "bearer_env" in value:
        var = t.string("bearer_env")
        assert var is not None
        if not env.get(var):
            raise t.fail("auth.bearer_env", f"the environment variable {var} is not set (or empty)")
        return Bearer(env=var)
    if "bearer_file" in value:
        file = t.string("bearer_file")
        assert file is not None
        if not Path(file).is_file():
            raise t.fail("auth.bearer_file", f"{file!r} is not a readable file")
        return Bearer(file=Path(file))
    cc = value["client_credentials"]
    if not isinstance(cc, dict):
        raise t.fail("auth.client_credentials", "must be a table { token_url, client_id, client_secret_env, scope }")
    c = _Table(cc, where)
    c.keys(CLIENT_CREDENTIALS_KEYS, "auth.client_credentials")
    token_url = c.string("token_url", required=True)
    client_id = c.string("client_id", required=True)
    secret_env = c.string("client_secret_env", required=True)
    assert token_url is not None
    assert client_id is not None
    assert secret_env is not None
    if not re.match(r"https?://[^/\s]+", token_url):
        raise c.fail("auth.client_credentials.token_url", f"{token_url!r} is not an http:// or https:// URL")
    if not env.get(secret_env):
        raise c.fail("auth.client_credentials.client_secret_env", f"the environment variable {secret_env} is not set")
    return ClientCredentials(token_url, client_id, secret_env, c.string("scope"))


def _forward(value: Any, where: str, url: str | None) -> Forward:
    if value is None:
        return Forward()
    if not isinstance(value, dict):
        raise UpstreamConfigError(f"{where}: forward: must be a table ([upstream.forward])")
    t = _Table(value, where)
    t.keys(FORWARD_KEYS, "[upstream.forward]")
    if not url:
        raise t.fail("forward", "headers reach an HTTP upstream (url) only")
    headers = {key: t.string(key) for key in sorted(FORWARD_KEYS)}
    for key, header in headers.items():
        if header is not None and (not HEADER.fullmatch(header) or header.lower() in RESERVED_HEADERS):
            raise t.fail(f"forward.{key}", f"{header!r} is not a header name this service may set")
    return Forward(**headers)
