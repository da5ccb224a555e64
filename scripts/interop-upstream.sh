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

NAME=upstream
# shellcheck source=scripts/interop-common.sh
source "$ROOT/scripts/interop-common.sh"

UP_PORT="$(free_port)"
(cd "$ROOT" && exec "$BIN/python" -m tests.upstream_server http "$UP_PORT") >"$LOGS/upstream.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$UP_PORT/mcp" "${PIDS[-1]}" "$LOGS/upstream.log" any
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
