"""The ``mcp-tasks`` command: serve, worker, migrate, call, tasks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any

from service.observability import logging as log_setup


def _settings() -> Any:
    from service.cli_config import load_settings

    return load_settings()


def _load_tools(settings: Any) -> None:
    """Import the tool packs and read the upstreams file now, so a wrong MCP_TASKS_TOOLS or
    MCP_TASKS_UPSTREAMS_FILE is a message, not a start-up traceback."""
    from service.core import load_upstreams
    from service.tools.registry import Registry

    try:
        registry = Registry.load(settings.tool_packs, max_runtime_s=settings.max_runtime_s)
    except ValueError as exc:
        sys.exit(f"mcp-tasks: MCP_TASKS_TOOLS: {exc}")
    try:
        load_upstreams(settings, registry)
    except ValueError as exc:  # the file's UpstreamConfigError: names the upstream and the key
        sys.exit(f"mcp-tasks: MCP_TASKS_UPSTREAMS_FILE: {exc}")


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
        timeout_graceful_shutdown=settings.graceful_timeout_s,
    )
    tune_gc()
    # Ctrl-C or SIGTERM: uvicorn drains and shuts down, then raises the signal again (SIGINT: a
    # KeyboardInterrupt; SIGTERM: this handler, as uvicorn restores it); the stop was asked for and
    # is done, so the process exits 0, as `worker` does.
    signal.signal(signal.SIGTERM, _stopped)
    with contextlib.suppress(KeyboardInterrupt):
        Server(config).run()


def _stopped(signum: int, frame: Any) -> None:
    raise SystemExit(0)


async def _worker_main() -> None:
    from service.core import check_schema, open_core, tune_gc
    from service.observability import tracing

    settings = _settings()
    tracing.configure("worker")  # on only with an OTLP endpoint set (OTEL_EXPORTER_OTLP_ENDPOINT)
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
    tracing.shutdown()


def _migrate(args: argparse.Namespace) -> None:
    from service.store import migrate

    settings = _settings()
    if not settings.database_url:
        sys.exit("mcp-tasks migrate: set MCP_TASKS_DATABASE_URL (the embedded database migrates itself on serve)")
    from alembic.util import CommandError

    try:
        done = migrate.upgrade_to_head(settings.database_url)
    except (CommandError, RuntimeError) as exc:  # a revision this version does not know, or before its baseline
        sys.exit(f"mcp-tasks migrate: {exc}")
    if done.changed:
        print(f"database upgraded from {done.before or 'an empty schema'} to {done.head} (head)")
    else:
        print(f"database already at head ({done.head}); nothing to do")


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
    from service.store.db import EXPORTER_ROLE, RUNNER_ROLE, Database
    from service.store.embedded import start_embedded
    from service.tasks.audit import AuditLog

    times: dict[str, datetime | None] = {}
    for option in ("since", "purge_before") if args.audit_command == "export" else ():
        text = getattr(args, option)
        try:
            times[option] = datetime.fromisoformat(text) if text else None
        except ValueError:
            flag = "--" + option.replace("_", "-")
            print(f"{flag} {text!r} is not an ISO 8601 time, e.g. 2026-11-01T00:00:00+00:00", file=sys.stderr)
            return 2
    before = times.get("purge_before")
    if before is not None and (times["since"] is not None or before.tzinfo is None):
        print("--purge-before needs a time with its UTC offset, and no --since: only rows written out from "
              "the start of their chain may be purged", file=sys.stderr)  # fmt: skip
        return 2
    settings = _settings()
    dsn = settings.database_url
    if dsn:
        try:
            await check_schema(dsn)
        except RuntimeError as exc:  # unreachable, or at another schema: say so and what to do, no traceback
            sys.exit(f"mcp-tasks audit: {exc}")
    else:
        dsn = await asyncio.to_thread(start_embedded, settings.data_dir)
    # A full export marks the chains written out (which lets a purge remove them): the export
    # role's alone, with a login of its own (docs/operations.md, "Retention").
    marks = args.audit_command == "export" and times["since"] is None
    db = Database(dsn, pool_size=2, role=EXPORTER_ROLE if marks else RUNNER_ROLE)
    try:
        await db.open()
    except RuntimeError as exc:
        sys.exit(f"mcp-tasks audit: {exc}")
    try:
        audit = AuditLog(db)
        if args.audit_command == "verify":
            problems = await audit.verify(args.tenant)
            for p in problems:
                print(f"BROKEN tenant={p.tenant_id} seq={p.seq}: {p.problem}")
            scope = f"tenant {args.tenant}" if args.tenant else "all tenants"
            print(f"audit chain of {scope}: {'intact' if not problems else f'{len(problems)} problem(s)'}")
            return 1 if problems else 0
        written: dict[str, int] = {}
        async for event in audit.export(args.tenant, times["since"], written=written):
            sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        # Written out from the start of each chain: retention may now purge these rows (and only these).
        if marks:
            await audit.mark_exported(written)
        if before is not None:
            for tenant_id, n in (await audit.purge(before, sorted(written))).items():
                print(f"purged {n} audit event(s) of tenant {tenant_id} dated before {before.isoformat()}",
                      file=sys.stderr)  # fmt: skip
        return 0
    finally:
        await db.close()


def main(argv: list[str] | None = None) -> None:
    try:
        _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # before a command's own handling (imports, settings): nothing was started
        print("\nmcp-tasks: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # any command's reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout at exit
        sys.exit(141)


def _main(argv: list[str]) -> None:
    if argv[:1] == ["bench"]:  # the load generator has its own options (mcp-tasks bench --help)
        from service.bench.loadgen import main as bench_main

        log_setup.configure("WARNING", "text")
        sys.exit(bench_main(argv[1:]))
    from service import cli_tasks

    args = _parser().parse_args(cli_tasks.protect_task_ids(argv))
    _configure_logging(args)
    _run_command(args)


def _parser() -> argparse.ArgumentParser:
    """Every command's options but ``bench``'s, which the load generator parses itself."""
    from service import __version__, cli_call, cli_tasks, cli_tools, cli_upstreams, cli_usage

    parser = argparse.ArgumentParser(prog="mcp-tasks", description="A durable, multi-tenant MCP Tasks server.")
    parser.add_argument("--version", action="version", version=f"mcp-tasks {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the HTTP server (and in-process runners)")
    sub.add_parser("worker", help="run task runners only, no HTTP")
    sub.add_parser("migrate", help="upgrade the configured database to the newest schema")
    _add_dev_issuer_parsers(sub)
    _add_audit_parser(sub)
    cli_usage.add_parser(sub)
    cli_upstreams.add_parser(sub)
    sub.add_parser("bench", help="load-test an MCP Tasks endpoint (ours or another): mcp-tasks bench --help")
    cli_call.add_parser(sub)
    config = sub.add_parser(
        "config", help="print every setting's value in force and where it came from (secrets masked)"
    )
    config.add_argument("--json", action="store_true", help="one JSON object per setting")
    cli_tasks.add_parser(sub)
    cli_tools.add_parser(sub)
    return parser


def _add_dev_issuer_parsers(sub: Any) -> None:
    """``dev-issuer`` and ``token``: the local OAuth server and a token from it."""
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


def _add_audit_parser(sub: Any) -> None:
    """``audit verify``, ``audit export`` and ``audit trail``."""
    from service import cli_audit

    audit = sub.add_parser("audit", help="verify the audit hash chains, export audit events, or show a trail")
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
    cli_audit.add_parser(audit_sub)


def _configure_logging(args: argparse.Namespace) -> None:
    """serve and worker log as their settings say (and load the tool packs); the rest log to a terminal."""
    if args.command in ("serve", "worker"):
        log_setup.configure("INFO", "text")  # until the settings say otherwise
        settings = _settings()
        log_setup.configure(settings.log_level, settings.log_format)
        _load_tools(settings)
    else:
        quiet = ("token", "audit", "tasks", "call", "tools", "usage", "upstreams")
        log_setup.configure("WARNING" if args.command in quiet else "INFO", "text")


def _run_command(args: argparse.Namespace) -> None:
    from service import cli_audit, cli_usage

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
    elif args.command == "audit" and args.audit_command == "trail":
        from service.cli_records import run_record_command

        sys.exit(run_record_command(cli_audit.trail_main(args)))
    elif args.command == "audit":
        sys.exit(asyncio.run(_audit_main(args)))
    elif args.command == "usage":
        from service.cli_records import run_record_command

        sys.exit(run_record_command(cli_usage.usage_main(args)))
    elif args.command == "upstreams":
        from service.cli_records import run_record_command
        from service.cli_upstreams import upstreams_main

        sys.exit(run_record_command(upstreams_main(args)))
    elif args.command == "config":
        from service.cli_config import config_main

        sys.exit(config_main(args))
    elif args.command in ("call", "tasks", "tools"):
        sys.exit(_client_command(args))


def _client_command(args: argparse.Namespace) -> int:
    """``call``, ``tasks`` and ``tools``: their exit codes and one-line errors (service.cli_exit)."""
    from service import cli_call, cli_tasks, cli_tools
    from service.cli_exit import CommandState, finish

    state = CommandState(args.url, token=args.token, wire=getattr(args, "wire", "2026-07-28"))
    if args.command == "call":
        return finish(cli_call.call_main(args, state), state)
    if args.command == "tools":
        return finish(cli_tools.tools_main(args, state), state)
    return finish(cli_tasks.tasks_main(args, state), state)
