# mcp-task-service: `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SHELL := /bin/bash
# The venv is installed from the hashed lock files (uv, seconds) and reinstalled when they change.
# `make run` needs the runtime lock only; every other target needs the dev lock too.
LOCKSUM = $(shell cat pyproject.toml requirements.lock requirements-dev.lock | cksum | cut -d' ' -f1)
RUN_STAMP := $(VENV)/.installed-run-$(LOCKSUM)
STAMP := $(VENV)/.installed-dev-$(LOCKSUM)
# uv from PATH if there is one, else the one the dev lock pins, installed into the venv by pip
# (one wheel, its hash checked).
UV = $(shell command -v uv 2>/dev/null || echo $(BIN)/uv)
UV_PIN = awk '/^uv==/{p=1} p{print} p && !/\\$$/{exit}' requirements-dev.lock

.DEFAULT_GOAL := help
.PHONY: promtool help run test security schema-check lint format interop faults soak bench plans bench-smoke ops-check lock lock-check dashboards clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(UV): | $(BIN)/python
	@echo "installing uv (the pinned, hashed one of requirements-dev.lock) into $(VENV)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps -r <($(UV_PIN))

$(RUN_STAMP): pyproject.toml requirements.lock | $(UV)
	@echo "installing the runtime dependencies from requirements.lock into $(VENV) (uv)"
	$(UV) pip install --quiet --python $(BIN)/python --require-hashes -r requirements.lock
	$(UV) pip install --quiet --python $(BIN)/python --no-deps -e .
	@rm -f $(VENV)/.installed-run-*; touch $@

$(STAMP): $(RUN_STAMP) requirements-dev.lock
	@echo "installing the development dependencies from requirements-dev.lock into $(VENV) (uv)"
	$(UV) pip install --quiet --python $(BIN)/python --require-hashes -r requirements-dev.lock
	@rm -f $(VENV)/.installed-dev-*; touch $@

run: $(RUN_STAMP) ## run the service (embedded PostgreSQL in .data/ unless MCP_TASKS_DATABASE_URL or MCP_TASKS_DATA_DIR is set)
	$(BIN)/mcp-tasks serve

# tests/security runs once, under `make security` (CI calls both); a bare `pytest` runs everything.
# The alert rules' tests run promtool: Debian's prometheus package has it (installed here as root,
# as CI runs; anyone else is told how, and those tests say so too).
promtool:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && echo "installing Debian's prometheus package (apt-get, as root) for promtool: the alert rules' tests need it" \
	  && apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; } \
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
	scripts/interop-upstream.sh

faults: $(STAMP) ## fault tests: real replicas behind haproxy, SIGTERM/SIGKILL, killed PostgreSQL connections, Redis down (minutes)
	$(BIN)/pytest tests/faults -s -q

soak: $(STAMP) ## mixed load for SOAK_SECONDS (default 900): RSS, open fds and p99 must stay flat, no errors (not in CI)
	$(BIN)/python bench/soak.py --seconds $${SOAK_SECONDS:-900}

bench: $(STAMP) ## side-by-side benchmark with the peers (pinned, 3 rounds; minutes); see docs/performance.md
	$(BIN)/python bench/run.py --doc docs/performance.md

plans: $(STAMP) ## the plan report: hot queries' EXPLAIN plans on shaped scratch databases (after SQL or index changes; not in CI)
	$(BIN)/python bench/plans.py

bench-smoke: $(STAMP) ## a seconds-long run of the benchmark harness (ours and the floor only), as in CI
	$(BIN)/python bench/run.py --smoke --out /var/tmp/mcp-tasks-bench-smoke.json

LOCK_CMD = $(UV) pip compile --quiet --universal --generate-hashes --python-version 3.11 --no-emit-index-url pyproject.toml

lock: $(STAMP) ## refresh requirements.lock (runtime: the image, `make run`) and requirements-dev.lock (runtime + dev) after changing pyproject.toml
	$(LOCK_CMD) --extra tracing --output-file requirements.lock
	$(LOCK_CMD) --extra tracing --extra dev -c requirements.lock --output-file requirements-dev.lock

# Pins only: a release that later gains a wheel (a new hash) does not make a lock stale.
lock-check: $(STAMP) ## requirements.lock and requirements-dev.lock are current with pyproject.toml (resolving again keeps every pin)
	@for lock in requirements.lock requirements-dev.lock; do extra="--extra tracing"; [ $$lock = requirements-dev.lock ] && extra="--extra tracing --extra dev -c requirements.lock"; \
	  tmp=$$(mktemp); cp $$lock $$tmp; $(LOCK_CMD) $$extra --output-file $$tmp; \
	  if diff -u <(grep -E '^[a-z0-9]' $$lock) <(grep -E '^[a-z0-9]' $$tmp); then rm -f $$tmp; \
	  else rm -f $$tmp; echo "$$lock is stale: run make lock"; exit 1; fi; done

dashboards: $(STAMP) ## regenerate grafana/dashboards/*.json from grafana/dashboards/generate.py
	$(BIN)/python grafana/dashboards/generate.py

ops-check: $(STAMP) lock-check promtool ## image, Helm chart, dashboards, alert rules, and the live Prometheus check (minutes)
	MCP_TASKS_OPS_SLOW=1 $(BIN)/pytest -rP tests/ops  # -rP: the live check names every panel and rule it evaluated

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
