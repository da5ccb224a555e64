"""The ``mcp-tasks`` command: serve, worker, migrate, call, tasks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from typing import Any

from pydantic import ValidationError

from service.observability import logging as log_setup


def _settings() -> Any:
    import os

    from service.config import Settings, describe_error, unknown_variables

    try:
        settings = Settings()
    except ValidationError as exc:
        problems = "\n  ".join(describe_error(dict(e)) for e in exc.errors())
        sys.exit(f"mcp-tasks: invalid settings:\n  {problems}")
    log = logging.getLogger("service")
    for name, close in unknown_variables(dict(os.environ)):
        hint = f"; did you mean {close}?" if close else ""
        log.warning("%s is not a setting of mcp-tasks and is ignored%s", name, hint)
    for note in settings.adjustments():
        log.info("%s", note)
    return settings


def _load_tools(settings: Any) -> None:
    """Import the tool packs now, so a wrong MCP_TASKS_TOOLS is a message, not a start-up traceback."""
    from service.tools.registry import Registry

    try:
        Registry.load(settings.tool_packs)
    except ValueError as exc:
        sys.exit(f"mcp-tasks: MCP_TASKS_TOOLS: {exc}")


def _config(args: argparse.Namespace) -> None:
    from service.config import masked

    settings = _settings()
    for name in sorted(type(settings).model_fields):
        print(f"MCP_TASKS_{name.upper()}={json.dumps(masked(name, getattr(settings, name)), default=str)}")
    print(f"# effective: auth={settings.effective_auth} public_url={settings.effective_public_url} "
          f"default_ttl_ms={settings.effective_default_ttl_ms} max_ttl_ms={settings.effective_max_ttl_ms}")  # fmt: skip


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from service.app import begin_shutdown, create_app
    from service.core import check_schema, tune_gc
    from service.http_server import raise_open_files_limit, server_config

    settings = _settings()
    try:
        app = create_app(settings)
        if settings.database_url:
            asyncio.run(check_schema(settings.database_url))
    except (RuntimeError, OSError) as exc:
        sys.exit(f"mcp-tasks serve: {exc}")

    class Server(uvicorn.Server):
        """uvicorn's server, telling the app the moment a shutdown starts (before it waits for
        open connections), so long streams end gracefully instead of being cut."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            begin_shutdown(app)
            super().handle_exit(sig, frame)

    raise_open_files_limit(settings)
    config = server_config(
        app,
        settings,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # keep our structured handler
        # Open streams (tasks/result) get the same grace as running tasks; both end by its deadline.
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
    )
    tune_gc()
    # Ctrl-C: uvicorn drains and shuts down, then raises the signal again, which asyncio turns into
    # a KeyboardInterrupt; the stop was asked for and is done, as `worker` treats it.
    with contextlib.suppress(KeyboardInterrupt):
        Server(config).run()


async def _worker_main() -> None:
    from service.core import check_schema, open_core, tune_gc

    settings = _settings()
    try:
        if settings.database_url:
            await check_schema(settings.database_url)
        core = await open_core(settings, run_tasks=True)
    except (RuntimeError, OSError) as exc:
        sys.exit(f"mcp-tasks worker: {exc}")
    tune_gc()
    from service import __version__
    from service.app import readiness
    from service.observability import metrics
    from service.observability.endpoint import MetricsEndpoint

    metrics.configure(
        tenant_label=settings.metrics_tenant_label,
        tenant_limit=settings.metrics_tenant_limit,
        version=__version__,
        component="worker",
    )
    endpoint = None
    if settings.metrics_port:
        endpoint = MetricsEndpoint(settings.host, settings.metrics_port, lambda: readiness(core))
        try:
            await endpoint.start()
        except OSError as exc:
            await core.close()
            sys.exit(f"mcp-tasks worker: metrics port {settings.metrics_port}: {exc}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logging.getLogger("service").info("worker running (%s slots); Ctrl-C to stop", core.settings.runner_concurrency)
    await stop.wait()
    if endpoint is not None:
        await endpoint.close()
    await core.close()


def _migrate(args: argparse.Namespace) -> None:
    from service.store import migrate

    settings = _settings()
    if not settings.database_url:
        sys.exit("mcp-tasks migrate: set MCP_TASKS_DATABASE_URL (the embedded database migrates itself on serve)")
    from alembic.util import CommandError

    try:
        done = migrate.upgrade_to_head(settings.database_url)
    except CommandError as exc:  # e.g. the database is at a revision this version does not know
        sys.exit(f"mcp-tasks migrate: {exc}")
    if done.changed:
        print(f"database upgraded from {done.before or 'an empty schema'} to {done.head} (head)")
    else:
        print(f"database already at head ({done.head}); nothing to do")


def _parse_arg(raw: str, *, as_json: bool = False) -> tuple[str, Any]:
    """``--arg k=v`` (a string) or ``--json-arg k=JSON``; the tool's schema converts the string
    where it expects a number or a boolean."""
    flag = "--json-arg" if as_json else "--arg"
    key, sep, value = raw.partition("=")
    if not sep or not key:
        raise SystemExit(f"{flag} needs key=value, got {raw!r}")
    if not as_json:
        return key, value
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--json-arg {key}: not JSON ({exc.msg}); use --arg for a plain string") from None


async def _ask(request: dict[str, Any]) -> dict[str, Any]:
    """One input request (elicitation) answered at the terminal: yes or no."""
    params = request.get("params", {})
    # The prompt goes to stderr, so stdout stays the result alone (a pipe, --json).
    print(f"{params.get('message', 'input?')} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = (await asyncio.to_thread(input)).strip().lower()
    except EOFError:  # no terminal to ask: decline rather than guess
        return {"action": "decline"}
    return {"action": "accept", "content": {"ok": answer in ("y", "yes")}}


async def _call_modern(args: argparse.Namespace, arguments: dict[str, Any]) -> int:
    """2026-07-28: the call may answer at once, ask for input first, or become a task, which we
    follow through subscriptions/listen (or by polling tasks/get when the server will not)."""
    from service.client import McpClientError, ModernClient

    async with ModernClient(args.url, token=args.token) as client:
        try:
            params: dict[str, Any] = {"name": args.tool, "arguments": arguments}
            result = await client.request("tools/call", params)
            while result.get("resultType") == "input_required":
                answers = {key: await _ask(req) for key, req in result.get("inputRequests", {}).items()}
                result = await client.request("tools/call", {**params, "inputResponses": answers})
            if result.get("resultType") != "task":
                print(json.dumps({k: v for k, v in result.items() if k not in ("resultType", "_meta")}, indent=2))
                return 1 if result.get("isError") else 0
            task_id = result["taskId"]
            print(f"task {task_id} {result['status']}", file=sys.stderr)
            task = await _follow_modern(client, task_id, int(result.get("pollIntervalMs", 1000)))
        except McpClientError as exc:
            print(f"error {exc}", file=sys.stderr)
            return 1
    status = task["status"]
    if status == "completed":
        out = {k: v for k, v in task["result"].items() if k != "resultType"}
        print(json.dumps(out, indent=2))
        return 1 if out.get("isError") else 0
    if status == "failed":
        print(f"error {task['error'].get('code')}: {task['error'].get('message')}", file=sys.stderr)
        return 1
    print(f"task {status}", file=sys.stderr)
    return 1


async def _follow_modern(client: Any, task_id: str, poll_ms: int) -> dict[str, Any]:
    """The task's final state, answering its questions on the way."""
    import httpx

    from service.client import McpClientError

    answered: set[str] = set()
    last_status = None

    async def on_state(task: dict[str, Any]) -> bool:
        nonlocal last_status
        if task["status"] != last_status or task.get("statusMessage"):
            message = f" {task['statusMessage']}" if task.get("statusMessage") else ""
            print(f"  status {task['status']}{message}", file=sys.stderr)
            last_status = task["status"]
        pending = {k: v for k, v in task.get("inputRequests", {}).items() if k not in answered}
        if pending:
            answers = {key: await _ask(req) for key, req in pending.items()}
            answered.update(answers)
            await client.request("tasks/update", {"taskId": task_id, "inputResponses": answers})
        return task["status"] in ("completed", "failed", "cancelled")

    try:
        async for message in client.listen([task_id]):
            if message.get("method") == "notifications/tasks":
                task = message["params"]
                if await on_state(task):
                    return dict(task)
    except (McpClientError, httpx.HTTPError):
        pass  # no subscriptions here, or the stream broke (a restart): poll, which retries
    while True:
        task = dict(await client.request("tasks/get", {"taskId": task_id}))
        if await on_state(task):
            return task
        await asyncio.sleep(poll_ms / 1000)


async def _call_main(args: argparse.Namespace) -> int:
    from service.client import McpClient, McpClientError

    arguments = dict(_parse_arg(a) for a in args.arg)
    arguments.update(_parse_arg(a, as_json=True) for a in args.json_arg)
    if args.wire == "2026-07-28":
        return await _call_modern(args, arguments)
    async with McpClient(args.url, token=args.token) as client:
        try:
            await client.initialize()
            created = await client.request(
                "tools/call",
                {
                    "name": args.tool,
                    "arguments": arguments,
                    "task": {"ttl": args.ttl},
                    "_meta": {"progressToken": "cli"},
                },
            )
        except McpClientError as exc:
            print(f"error {exc}", file=sys.stderr)
            return 1
        task_id = created["task"]["taskId"]
        print(f"task {task_id} {created['task']['status']}", file=sys.stderr)
        final: dict[str, Any] = {}
        async for message in client.stream("tasks/result", {"taskId": task_id}):
            method = message.get("method")
            if method == "notifications/progress":
                p = message["params"]
                total = f"/{p['total']:g}" if "total" in p else ""
                print(f"  progress {p['progress']:g}{total} {p.get('message', '')}", file=sys.stderr)
            elif method == "notifications/tasks/status":
                print(f"  status {message['params']['status']}", file=sys.stderr)
            elif method == "elicitation/create":
                await client.respond(message["id"], await _ask(message))
            elif "id" in message and "method" not in message:
                final = message
        if "error" in final:
            print(f"error {final['error'].get('code')}: {final['error'].get('message')}", file=sys.stderr)
            return 1
        print(json.dumps(final.get("result"), indent=2))
        return 1 if final.get("result", {}).get("isError") else 0


def _dev_issuer(args: argparse.Namespace) -> None:
    from service.auth.dev_issuer_cli import run_dev_issuer

    settings = _settings()
    key_path = None if args.ephemeral else settings.data_dir / "dev-issuer" / "signing-key.json"
    run_dev_issuer(args.host, args.port, args.audience or settings.effective_audience, key_path)


def _token(args: argparse.Namespace) -> None:
    from service.auth.dev_issuer_cli import request_token

    settings = _settings()
    resource = args.resource or settings.effective_audience
    print(request_token(args.issuer, tenant=args.tenant, subject=args.subject, scope=args.scope, resource=resource))


async def _audit_main(args: argparse.Namespace) -> int:
    from datetime import datetime

    from service.core import check_schema
    from service.store.db import RUNNER_ROLE, Database
    from service.store.embedded import start_embedded
    from service.tasks.audit import AuditLog

    settings = _settings()
    dsn = settings.database_url
    if dsn:
        try:
            await check_schema(dsn)
        except RuntimeError as exc:  # unreachable, or at another schema: say so and what to do, no traceback
            sys.exit(f"mcp-tasks audit: {exc}")
    else:
        dsn = await asyncio.to_thread(start_embedded, settings.data_dir)
    db = Database(dsn, pool_size=2, role=RUNNER_ROLE)
    await db.open()
    try:
        audit = AuditLog(db)
        if args.audit_command == "verify":
            problems = await audit.verify(args.tenant)
            for p in problems:
                print(f"BROKEN tenant={p.tenant_id} seq={p.seq}: {p.problem}")
            scope = f"tenant {args.tenant}" if args.tenant else "all tenants"
            print(f"audit chain of {scope}: {'intact' if not problems else f'{len(problems)} problem(s)'}")
            return 1 if problems else 0
        times: dict[str, datetime | None] = {}
        for option in ("since", "purge_before"):
            text = getattr(args, option)
            try:
                times[option] = datetime.fromisoformat(text) if text else None
            except ValueError:
                flag = "--" + option.replace("_", "-")
                print(f"{flag} {text!r} is not an ISO 8601 time, e.g. 2026-11-01T00:00:00+00:00", file=sys.stderr)
                return 2
        before = times["purge_before"]
        if before is not None and (times["since"] is not None or before.tzinfo is None):
            print("--purge-before needs a time with its UTC offset, and no --since: only rows written out from "
                  "the start of their chain may be purged", file=sys.stderr)  # fmt: skip
            return 2
        written: dict[str, int] = {}
        async for event in audit.export(args.tenant, times["since"], written=written):
            sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        # Written out from the start of each chain: retention may now purge these rows (and only these).
        if times["since"] is None:
            await audit.mark_exported(written)
        if before is not None:
            for tenant_id, n in (await audit.purge(before, sorted(written))).items():
                print(f"purged {n} audit event(s) of tenant {tenant_id} dated before {before.isoformat()}",
                      file=sys.stderr)  # fmt: skip
        return 0
    finally:
        await db.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the load generator has its own options (mcp-tasks bench --help)
        from service.bench.loadgen import main as bench_main

        log_setup.configure("WARNING", "text")
        sys.exit(bench_main(argv[1:]))
    from service import __version__

    parser = argparse.ArgumentParser(prog="mcp-tasks", description="A durable, multi-tenant MCP Tasks server.")
    parser.add_argument("--version", action="version", version=f"mcp-tasks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the HTTP server (and in-process runners)")
    sub.add_parser("worker", help="run task runners only, no HTTP")
    sub.add_parser("migrate", help="upgrade the configured database to the newest schema")
    dev = sub.add_parser(
        "dev-issuer", help="a local OAuth authorization server for trying hosted mode (NEVER production)"
    )
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=9000)
    dev.add_argument("--audience", default=None, help="default token audience (default: the service's public URL)")
    dev.add_argument("--ephemeral", action="store_true", help="keep the signing key in memory only")
    tok = sub.add_parser("token", help="mint an access token from a running dev issuer")
    tok.add_argument("--tenant", required=True)
    tok.add_argument("--subject", required=True)
    tok.add_argument("--scope", default="tasks")
    tok.add_argument("--issuer", default="http://127.0.0.1:9000")
    tok.add_argument("--resource", default=None, help="audience (default: the service's public URL)")
    audit = sub.add_parser("audit", help="verify the audit hash chains, or export audit events")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    verify = audit_sub.add_parser("verify", help="check every tenant's chain (exit 1 if any is broken)")
    verify.add_argument("--tenant", default=None)
    export = audit_sub.add_parser("export", help="write events as JSON lines, in chain order")
    export.add_argument("--tenant", default=None)
    export.add_argument("--since", default=None, help="ISO 8601 time, e.g. 2026-11-01T00:00:00+00:00")
    export.add_argument(
        "--purge-before",
        default=None,
        help="after writing, delete the written events dated before this time (the chain keeps a checkpoint)",
    )
    sub.add_parser("bench", help="load-test an MCP Tasks endpoint (ours or another): mcp-tasks bench --help")
    call = sub.add_parser("call", help="run a tool as a task, show progress, print the result")
    call.add_argument("tool")
    call.add_argument("--arg", action="append", default=[], help="key=value, the value a string")
    call.add_argument("--json-arg", action="append", default=[], help="key=JSON, e.g. items=[1,2] or ok=true")
    call.add_argument("--url", default="http://127.0.0.1:8000/mcp")
    call.add_argument("--token", default=None)
    call.add_argument(
        "--ttl", type=int, default=600_000, help="requested TTL (2025-11-25 only; the server chooses on 2026-07-28)"
    )
    call.add_argument(
        "--wire",
        choices=["2026-07-28", "2025-11-25"],
        default="2026-07-28",
        help="protocol revision to speak (default: 2026-07-28 with the Tasks extension)",
    )
    sub.add_parser("config", help="print the effective settings (secrets masked)")
    from service.cli_tasks import add_parser as add_tasks_parser
    from service.cli_tasks import protect_task_ids

    add_tasks_parser(sub)
    args = parser.parse_args(protect_task_ids(argv))
    if args.command in ("serve", "worker"):
        log_setup.configure("INFO", "text")  # until the settings say otherwise
        settings = _settings()
        log_setup.configure(settings.log_level, settings.log_format)
        _load_tools(settings)
    else:
        log_setup.configure("WARNING" if args.command in ("token", "audit", "tasks") else "INFO", "text")
    if args.command == "serve":
        _serve(args)
    elif args.command == "worker":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_worker_main())
    elif args.command == "migrate":
        _migrate(args)
    elif args.command == "dev-issuer":
        _dev_issuer(args)
    elif args.command == "token":
        _token(args)
    elif args.command == "audit":
        sys.exit(asyncio.run(_audit_main(args)))
    elif args.command == "call":
        sys.exit(asyncio.run(_call_main(args)))
    elif args.command == "config":
        _config(args)
    elif args.command == "tasks":
        from service.cli_tasks import tasks_main

        sys.exit(asyncio.run(tasks_main(args)))
