#!/usr/bin/env bash
# Interop through upstreams (issue 41): the independent clients call tools that live on upstream MCP
# servers behind a real `mcp-tasks serve`, and must see no deviation:
#   - py_task_client.py --tool-prefix up.    (2025-11-25, official Python SDK 1.30): sleep, echo, confirm on
#     a Streamable HTTP upstream; --tool-prefix local. the same on a stdio upstream
#   - ext_task_client.py (2026-07-28, raw httpx) with --task-tool/--input-tool/--cancel-tool naming upstream
#     tools, on both upstreams
# The upstream is tests/upstream_server.py (the official MCP Python SDK's FastMCP, no tasks of its own).
# Run by `make interop` after the other two scripts. Peers are installed under $PEERS (default /tmp/peers).
set -euo pipefail
export MCP_TASKS_SHUTDOWN_GRACE_S=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SHARED="${MCP_TASKS_SHARED:-$ROOT/../shared}"
PEERS="${PEERS:-/tmp/peers}"
BIN="$ROOT/.venv/bin"
LOGS="$(mktemp -d /var/tmp/mcp-tasks-interop-upstream.XXXXXX)"
[ -d "$SHARED/peers" ] || { echo "interop-upstream: $SHARED/peers not found; set MCP_TASKS_SHARED" >&2; exit 2; }

echo "== installing peers under $PEERS (logs in $LOGS)"
PEERS="$PEERS" PEERS_EXT=1 PEERS_SRC="$SHARED/peers" bash "$ROOT/scripts/install-peers.sh" >"$LOGS/install.log" 2>&1 \
  || { tail -30 "$LOGS/install.log"; exit 2; }

DB_NAME="mcp_tasks_up_$$_$RANDOM"
ADMIN_URL="${MCP_TASKS_TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres}"
PIDS=()
DB_URL=""
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$DB_URL" ]; then
    "$BIN/python" - "$ADMIN_URL" "$DB_NAME" <<'PY' || true
import asyncio, sys, asyncpg
async def main():
    c = await asyncpg.connect(sys.argv[1]); await c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[2]}" WITH (FORCE)'); await c.close()
asyncio.run(main())
PY
  fi
  return 0
}
trap cleanup EXIT

"$BIN/python" - "$ADMIN_URL" "$DB_NAME" <<'PY' || { echo "interop-upstream: cannot create a database at $ADMIN_URL" >&2; exit 2; }
import asyncio, sys, asyncpg
async def main():
    c = await asyncpg.connect(sys.argv[1], timeout=3); await c.execute(f'CREATE DATABASE "{sys.argv[2]}"'); await c.close()
asyncio.run(main())
PY
DB_URL="${ADMIN_URL%/*}/$DB_NAME"
MCP_TASKS_DATABASE_URL="$DB_URL" "$BIN/mcp-tasks" migrate >"$LOGS/migrate.log" 2>&1 || { tail -20 "$LOGS/migrate.log"; exit 2; }
export MCP_TASKS_DATABASE_URL="$DB_URL"
unset MCP_TASKS_DATA_DIR

free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() {  # wait_ready URL PID LOG [STATUS...]: any answer (an MCP endpoint answers a GET with 4xx)
  for _ in $(seq 1 150); do
    curl -sS -o /dev/null "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { tail -30 "$3"; exit 2; }
    sleep 0.2
  done
  echo "interop-upstream: $1 not ready" >&2; tail -30 "$3"; exit 2
}

UP_PORT="$(free_port)"
(cd "$ROOT" && exec "$BIN/python" -m tests.upstream_server http "$UP_PORT") >"$LOGS/upstream.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$UP_PORT/mcp" "${PIDS[-1]}" "$LOGS/upstream.log"
cat >"$LOGS/upstreams.toml" <<EOF
[[upstream]]
name = "up"
url = "http://127.0.0.1:$UP_PORT/mcp"

[[upstream]]
name = "local"
command = ["$BIN/python", "-m", "tests.upstream_server", "stdio"]
cwd = "$ROOT"
EOF

PORT="$(free_port)"
URL="http://127.0.0.1:$PORT/mcp"
MCP_TASKS_PORT="$PORT" MCP_TASKS_TOOLS=service.tools.demo MCP_TASKS_UPSTREAMS_FILE="$LOGS/upstreams.toml" \
  "$BIN/mcp-tasks" serve >"$LOGS/server.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$PORT/readyz" "${PIDS[-1]}" "$LOGS/server.log"
echo "== mcp-tasks serve at $URL, upstreams up (HTTP, port $UP_PORT) and local (stdio)"

passed=0; failed=0
check() {  # check NAME COMMAND...: run, keep the log, count
  local name="$1"; shift
  if "$@" >"$LOGS/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "  ok    $name"
  else
    failed=$((failed + 1)); echo "  FAIL  $name (log: $LOGS/$name.log)"; tail -25 "$LOGS/$name.log" | sed 's/^/        /'
  fi
}
for up in up local; do
  check "py_task_client_$up" "$PEERS/venv-mcp1/bin/python" "$SHARED/peers/py_task_client.py" "$URL" --tool-prefix "$up."
  check "ext_task_client_$up" "$PEERS/venv-extclient/bin/python" "$SHARED/peers/ext_task_client.py" "$URL" \
    --task-tool "$up.sleep" --task-args '{"seconds": 2}' --input-tool "$up.confirm" --input-args '{"prompt": "Proceed?"}' \
    --cancel-tool "$up.sleep" --cancel-args '{"seconds": 60}'
done

echo "interop-upstream: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
