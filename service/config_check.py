"""What is wrong with an environment, said in its own terms: variables that look like settings but
are not read (typos), a setting's error naming the variable and the value given, and values fit to
print (secrets masked). For ``mcp-tasks config`` and the start-up's warnings."""

from __future__ import annotations

import re
from typing import Any

from service.config import Settings

SECRET_FIELDS = frozenset({"oauth_client_secret"})
URL_FIELDS = frozenset({"database_url", "rate_limit_storage", "oauth_introspection_url"})


def masked(name: str, value: Any) -> Any:
    """A setting's value fit to print: secrets hidden, passwords in URLs too."""
    if value is None:
        return None
    if name in SECRET_FIELDS:
        return "********"
    if name in URL_FIELDS and isinstance(value, str):
        return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1********@", value)
    return value


# Variables read elsewhere than Settings: the tests' database, the interop scripts' shared folder,
# the ops tests' switch, and the file of settings `Settings.from_environment` reads.
OTHER_VARIABLES = frozenset(
    {"MCP_TASKS_TEST_DATABASE_URL", "MCP_TASKS_SHARED", "MCP_TASKS_OPS_SLOW", "MCP_TASKS_ENV_FILE"}
)
# A prefix that is almost ours: MCP_TASK_, MCPTASKS_, MCP_TAKS_, ... (anything but MCP_TASKS_ itself).
_NEAR_PREFIX = re.compile(r"MCP[_-]?T[A-Z]{2,4}S?[_-]?")


def unknown_variables(environ: dict[str, str]) -> list[tuple[str, str | None]]:
    """Variables that look like settings but are not read (a typo ignored silently otherwise), each
    with the likely intended setting: an ``MCP_TASKS_*`` name no setting has, a near miss of the
    prefix (``MCP_TASK_DATABASE_URL``), and a bare ``DATABASE_URL`` while ours is unset."""
    import difflib

    fields = {name.upper() for name in Settings.model_fields}
    known = {f"MCP_TASKS_{name}" for name in fields} | OTHER_VARIABLES
    given = {name.upper() for name in environ}
    out: list[tuple[str, str | None]] = []
    for name in sorted(environ):
        upper = name.upper()
        if upper in known:
            continue
        if upper.startswith("MCP_TASKS_"):
            close = difflib.get_close_matches(upper, known, n=1)
            out.append((name, close[0] if close else None))
        elif (near := _NEAR_PREFIX.match(upper)) and near.end() < len(upper):
            rest = upper[near.end() :]
            close = difflib.get_close_matches(rest, fields, n=1, cutoff=0.8)
            if close:
                out.append((name, f"MCP_TASKS_{close[0]}"))
        elif upper == "DATABASE_URL" and "MCP_TASKS_DATABASE_URL" not in given:
            out.append((name, "MCP_TASKS_DATABASE_URL"))
    return out


def describe_error(error: dict[str, Any]) -> str:
    """A pydantic error on a setting, naming the variable, the value given and what is allowed."""
    loc = [str(part) for part in error.get("loc", ())]
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    if not loc:
        return message
    variable = f"MCP_TASKS_{loc[0].upper()}"
    given = error.get("input")
    allowed = ""
    ctx = error.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in message:
        allowed = f" (allowed: {ctx['expected']})"
    shown = masked(loc[0], given) if not isinstance(given, dict) else None
    return f"{variable}={shown!r}: {message}{allowed}" if shown is not None else f"{variable}: {message}{allowed}"
