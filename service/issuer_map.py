"""MCP_TASKS_OAUTH_ISSUER_TENANTS: which tenants each trusted issuer may speak for, and the
patterns of two issuers that a tenant could match both of (docs/decisions.md, "Tenants bound to
issuers")."""

from __future__ import annotations

import functools


def wildcard_overlap(bound: dict[str, tuple[str, ...]]) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """Two issuers' tenant patterns that some tenant matches both of, where at least one is a
    pattern ('*'): ((issuer, pattern), (issuer, pattern)), or None. The same name listed by both is
    a tenant shared on purpose, not an overlap."""
    issuers = list(bound)
    for i, first in enumerate(issuers):
        for second in issuers[i + 1 :]:
            for one in bound[first]:
                for other in bound[second]:
                    if ("*" in one or "*" in other) and _globs_meet(one, other):
                        return ((first, one), (second, other)) if "*" in other else ((second, other), (first, one))
    return None


def _globs_meet(p: str, q: str) -> bool:
    """Whether some string matches both patterns ('*': any run of characters)."""

    @functools.cache
    def meet(i: int, j: int) -> bool:
        if i == len(p) and j == len(q):
            return True
        if i < len(p) and p[i] == "*":
            return meet(i + 1, j) or (j < len(q) and meet(i, j + 1))
        if j < len(q) and q[j] == "*":
            return meet(i, j + 1) or (i < len(p) and meet(i + 1, j))
        return i < len(p) and j < len(q) and p[i] == q[j] and meet(i + 1, j + 1)

    return meet(0, 0)
