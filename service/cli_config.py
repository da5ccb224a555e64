"""Settings as the commands load them (environment, then an optional file) and ``mcp-tasks config``:
every setting's value in force, where it came from, and what an unset one means."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.config import Settings, source_checkout
from service.config_check import describe_error, masked, unknown_variables

ENV_FILE_VARIABLE = "MCP_TASKS_ENV_FILE"


@dataclass(frozen=True)
class SettingValue:
    """One line of ``mcp-tasks config``: the variable, its value in force (masked), where it came
    from (``default``, ``environment`` or ``file``) and, for a default, what it follows."""

    variable: str
    value: Any
    source: str
    note: str = ""


def env_file_values(environ: dict[str, str]) -> tuple[Path | None, dict[str, str]]:
    """The file named by MCP_TASKS_ENV_FILE (``NAME=value`` lines) and its variables, upper-cased."""
    name = environ.get(ENV_FILE_VARIABLE)
    if not name:
        return None, {}
    from dotenv import dotenv_values

    path = Path(name)
    if not path.is_file():
        sys.exit(f"mcp-tasks: {ENV_FILE_VARIABLE}={name!r}: no such file")
    return path, {k.upper(): v for k, v in dotenv_values(path).items() if v is not None}


def load_settings() -> Settings:
    """The settings of this process, read once: the environment, then MCP_TASKS_ENV_FILE for what
    the environment does not set. Invalid ones end the process with one line per problem; variables
    that look like settings but are not (typos) are warnings naming the likely intended one."""
    environ = dict(os.environ)
    path, from_file = env_file_values(environ)
    try:
        settings = Settings(_env_file=path) if path is not None else Settings()
    except ValidationError as exc:
        problems = "\n  ".join(describe_error(dict(e)) for e in exc.errors())
        sys.exit(f"mcp-tasks: invalid settings:\n  {problems}")
    log = logging.getLogger("service")
    for origin, variables in (("", environ), (f" (in {path})", from_file)):
        for name, close in unknown_variables(variables):
            hint = f"; did you mean {close}?" if close else ""
            log.warning("%s%s is not a setting of mcp-tasks and is ignored%s", name, origin, hint)
    for note in settings.adjustments():
        log.info("%s", note)
    return settings


def _unset_meaning(settings: Settings, name: str) -> tuple[Any, str]:
    """The value in force of a setting left unset (None), and what it follows."""
    followed: dict[str, tuple[Any, str]] = {
        "database_url": (None, f"embedded PostgreSQL in {settings.data_dir / 'pgdata'}"),
        "public_url": (settings.effective_public_url, "from MCP_TASKS_HOST and MCP_TASKS_PORT"),
        "auth": (settings.effective_auth, "oauth when an issuer is set, else none"),
        "oauth_issuer": (None, "no issuer: single-user mode"),
        "oauth_jwks_url": (None, "discovered from the issuer" if settings.oauth_issuer else "unused: no issuer"),
        "oauth_audience": (settings.effective_audience, "MCP_TASKS_PUBLIC_URL"),
        "oauth_introspection_url": (None, "none: opaque tokens are refused"),
        "oauth_client_id": (None, "none (introspection only)"),
        "oauth_client_secret": (None, "none (introspection only)"),
        "default_ttl_ms": (settings.effective_default_ttl_ms, f"built-in for auth={settings.effective_auth}"),
        "max_ttl_ms": (settings.effective_max_ttl_ms, f"built-in for auth={settings.effective_auth}"),
        "runner_tenant_share": (
            "100%" if settings.effective_auth == "none" else "50%",
            f"{settings.effective_tenant_share} of {settings.runner_concurrency} slots",
        ),
        "audit_retention_days": (None, "keep every row until an export purges it"),
        "metrics_port": (None, "/metrics on MCP_TASKS_PORT"),
    }
    return followed.get(name, (None, "unset"))


def describe_settings(settings: Settings, environ: dict[str, str], from_file: dict[str, str]) -> list[SettingValue]:
    """Every setting, in name order, with its value in force and its source."""
    given = {k.upper() for k in environ}
    rows = []
    for name in sorted(type(settings).model_fields):
        variable = f"MCP_TASKS_{name.upper()}"
        value: Any = getattr(settings, name)
        source = "environment" if variable in given else "file" if variable in from_file else "default"
        note = ""
        if value is None:
            value, note = _unset_meaning(settings, name)
        elif name == "data_dir" and source == "default":
            note = "this checkout's .data/" if source_checkout() and value.name == ".data" else "per user"
        elif name == "runner_tenant_share":
            note = f"{settings.effective_tenant_share} of {settings.runner_concurrency} slots"
        shown = masked(name, str(value) if isinstance(value, Path) else value)
        rows.append(SettingValue(variable, shown, source, note))
    return rows


def config_main(args: argparse.Namespace) -> int:
    settings = load_settings()
    path, from_file = env_file_values(dict(os.environ))
    rows = describe_settings(settings, dict(os.environ), from_file)
    if args.json:
        for row in rows:
            print(json.dumps({"variable": row.variable, "value": row.value, "source": row.source, "note": row.note}))
        return print_upstreams(settings, as_json=True)
    for row in rows:
        value = "" if row.value is None else json.dumps(row.value, default=str)
        source = f"file {path}" if row.source == "file" else row.source
        print(f"{row.variable}={value}  # {source}{': ' + row.note if row.note else ''}")
    return print_upstreams(settings, as_json=False)


def print_upstreams(settings: Settings, *, as_json: bool) -> int:
    """The upstreams file's effect: each upstream's settings, defaults filled in, secrets shown by
    where they come from only (1: the file cannot be used, said in one line)."""
    if not settings.upstreams_file:
        return 0
    from service.upstream.config import UpstreamConfigError, load

    try:
        upstreams = load(settings.upstreams_file)
    except UpstreamConfigError as exc:
        print(f"mcp-tasks config: MCP_TASKS_UPSTREAMS_FILE: {exc}", file=sys.stderr)
        return 1
    for upstream in upstreams:
        described = upstream.describe()
        if as_json:
            print(json.dumps({"upstream": described}))
        else:
            print(f"# upstream {upstream.name}: " + json.dumps(described))
    return 0
