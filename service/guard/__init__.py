"""Guardrails: rate limits (concurrency caps and TTL clamps live with the task use cases)."""
