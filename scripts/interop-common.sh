# Sourced by scripts/interop-ext.sh and scripts/interop-upstream.sh (after ROOT, BIN, LOGS and NAME
# are set): a database of the script's own on the local server (never the embedded default),
# migrated and exported as MCP_TASKS_DATABASE_URL, and, at exit, the processes in PIDS stopped and
# that database dropped; free_port and wait_ready.
DB_NAME="mcp_tasks_${NAME}_$$_$RANDOM"
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

"$BIN/python" - "$ADMIN_URL" "$DB_NAME" <<'PY' || { echo "interop-$NAME: cannot create a database at $ADMIN_URL" >&2; exit 2; }
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
wait_ready() {  # wait_ready URL PID LOG [any]: until URL answers 2xx (any: answers at all; an MCP endpoint answers a GET 4xx)
  local curl_flags=(-fsS)
  [ "${4:-}" = any ] && curl_flags=(-sS -o /dev/null)
  for _ in $(seq 1 150); do
    curl "${curl_flags[@]}" "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { tail -30 "$3"; exit 2; }
    sleep 0.2
  done
  echo "interop-$NAME: $1 not ready" >&2; tail -30 "$3"; exit 2
}
