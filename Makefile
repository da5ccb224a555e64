# mcp-task-service: `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SHELL := /bin/bash
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.DEFAULT_GOAL := help
.PHONY: promtool help run test security schema-check lint format interop faults soak bench bench-smoke ops-check lock lock-check dashboards clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*; touch $@

run: $(STAMP) ## run the service (embedded PostgreSQL unless MCP_TASKS_DATABASE_URL is set)
	$(BIN)/mcp-tasks serve

# tests/security runs once, under `make security` (CI calls both); a bare `pytest` runs everything.
# The alert rules' tests run promtool: Debian's prometheus package has it (installed here as root,
# as CI runs; anyone else is told how, and those tests say so too).
promtool:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; } \
	  || echo "promtool is missing: sudo apt-get install prometheus (the alert rules' tests need it)"

test: $(STAMP) promtool ## run the test suite (needs PostgreSQL: 127.0.0.1:5432, MCP_TASKS_TEST_DATABASE_URL, or embedded)
	$(BIN)/pytest --ignore=tests/security

security: $(STAMP) ## the attack tests of SECURITY.md (tests/security: loopback only, seconds each)
	$(BIN)/pytest tests/security -q

schema-check: $(STAMP) ## alembic/schema.sql against the migrations, and the migration tests (CONTRIBUTING.md)
	$(BIN)/pytest tests/test_schema_truth.py tests/test_migrations.py

lint: $(STAMP) ## ruff check, ruff format --check, mypy --strict, the import contracts (lint-imports), hadolint
	$(BIN)/ruff check service tests bench alembic grafana
	$(BIN)/ruff format --check service tests bench alembic grafana
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/hadolint Dockerfile

format: $(STAMP) ## apply ruff's fixes and formatting
	$(BIN)/ruff check --fix service tests bench alembic grafana
	$(BIN)/ruff format service tests bench alembic grafana

interop: $(STAMP) ## official clients and conformance suites against `mcp-tasks serve`, both wires (installs peers under /tmp/peers)
	scripts/interop.sh
	scripts/interop-ext.sh

faults: $(STAMP) ## fault tests: real replicas behind haproxy, SIGTERM/SIGKILL, killed PostgreSQL connections, Redis down (minutes)
	$(BIN)/pytest tests/faults -s -q

soak: $(STAMP) ## mixed load for SOAK_SECONDS (default 900): RSS, open fds and p99 must stay flat, no errors (not in CI)
	$(BIN)/python bench/soak.py --seconds $${SOAK_SECONDS:-900}

bench: $(STAMP) ## side-by-side benchmark with the peers (pinned, 3 rounds; minutes); see docs/performance.md
	$(BIN)/python bench/run.py --doc docs/performance.md

bench-smoke: $(STAMP) ## a seconds-long run of the benchmark harness (ours and the floor only), as in CI
	$(BIN)/python bench/run.py --smoke --out /var/tmp/mcp-tasks-bench-smoke.json

LOCK_CMD = $(BIN)/uv pip compile --quiet --universal --generate-hashes --python-version 3.11 --no-emit-index-url pyproject.toml

lock: $(STAMP) ## refresh requirements.lock (the image's pinned, hashed dependencies) after changing pyproject.toml
	$(LOCK_CMD) --output-file requirements.lock

# Pins only: a release that later gains a wheel (a new hash) does not make the lock stale.
lock-check: $(STAMP) ## requirements.lock is current with pyproject.toml (resolving again keeps every pin)
	@tmp=$$(mktemp); cp requirements.lock $$tmp; $(LOCK_CMD) --output-file $$tmp; \
	  if diff -u <(grep -E '^[a-z0-9]' requirements.lock) <(grep -E '^[a-z0-9]' $$tmp); then rm -f $$tmp; \
	  else rm -f $$tmp; echo "requirements.lock is stale: run make lock"; exit 1; fi

dashboards: $(STAMP) ## regenerate grafana/dashboards/*.json from grafana/dashboards/generate.py
	$(BIN)/python grafana/dashboards/generate.py

ops-check: $(STAMP) lock-check promtool ## image, Helm chart, dashboards, alert rules, and the live Prometheus check (minutes)
	MCP_TASKS_OPS_SLOW=1 $(BIN)/pytest -rP tests/ops  # -rP: the live check names every panel and rule it evaluated

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
