# syntax=docker/dockerfile:1
# mcp-task-service image: `mcp-tasks serve` as a non-root user on a slim, digest-pinned Python.
#
# Reproducible: the base is pinned by digest and every dependency by version and hash
# (requirements.lock, `make lock`); only prebuilt wheels are installed, so no compiler is needed in
# either stage. No HEALTHCHECK: the Helm chart's probes call /healthz and /readyz.
# tests/ops/test_image.py runs these same steps (wheel, locked install, non-root) without a
# container daemon.

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm@sha256:2199a62885a12290dc9c5be3ca0681d367576ab7bf037da120e564723292a2f0

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY requirements.lock ./
RUN python -m venv /opt/mcp-tasks \
 && /opt/mcp-tasks/bin/pip install --require-hashes --only-binary=:all: --no-deps -r requirements.lock
# .dockerignore admits only the project's metadata and its package (and alembic/ once it moves there).
COPY . ./
# The project itself goes in without its dependencies: they all came from the lock above.
RUN /opt/mcp-tasks/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/mcp-tasks/bin/pip install --no-deps /wheels/*.whl \
 && /opt/mcp-tasks/bin/pip check

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="mcp-task-service" \
      org.opencontainers.image.description="A durable, multi-tenant MCP Tasks server on PostgreSQL" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 mcp-tasks \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin mcp-tasks
COPY --from=build /opt/mcp-tasks /opt/mcp-tasks
# Listening on every address means hosted mode: without MCP_TASKS_OAUTH_ISSUER the service refuses
# to start (single-user mode is loopback only), so an image run by mistake exposes nothing.
ENV PATH=/opt/mcp-tasks/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MCP_TASKS_HOST=0.0.0.0 \
    MCP_TASKS_PORT=8000
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["mcp-tasks"]
CMD ["serve"]
