"""An audit event's canonical text (T-SEC-10): the chain hashes it, so it must never change.

audit_canonical writes it directly instead of rendering a jsonb object of the event's fields (the
first definition, which every chain was hashed with); these tests hold the body to that
reference over every field's edge cases and over generated events, under unusual session
settings.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The first definition: the jsonb object's text, which audit_canonical's output must equal.
REFERENCE = """jsonb_build_object(
    'tenant_id', e.tenant_id, 'seq', e.seq,
    'at', to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    'action', e.action, 'outcome', e.outcome, 'subject', e.subject, 'client_id', e.client_id,
    'issuer', e.issuer, 'task_id', e.task_id, 'request_id', e.request_id,
    'client_address', e.client_address, 'detail', e.detail)::text"""

TEXT_FIELDS = ("tenant_id", "action", "outcome", "subject", "client_id", "issuer", "task_id", "request_id",
               "client_address")  # fmt: skip

# Both texts for many events at once: one array per field, each event rebuilt as an audit_events row.
COMPARE = f"""
SELECT o, want, audit_canonical(ROW(e.tenant_id, e.seq, e.at, e.action, e.outcome, e.subject, e.client_id, e.issuer,
                                    e.task_id, e.request_id, e.client_address, e.detail, decode('00', 'hex'),
                                    decode('00', 'hex'))::audit_events) AS got
FROM (SELECT u.*, {REFERENCE.replace("e.at", "u.at::timestamptz").replace("e.", "u.")} AS want
      FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                  $8::text[], $9::text[], $10::text[], $11::text[], $12::jsonb[])
           WITH ORDINALITY AS u(tenant_id, seq, at, action, outcome, subject, client_id, issuer, task_id,
                                request_id, client_address, detail, o)) e
ORDER BY o
"""

AWKWARD = [
    "",
    "plain",
    '"',
    "\\",
    "/",
    "\b\f\n\r\t",
    "".join(chr(c) for c in range(1, 128)),  # every ASCII character but NUL (text cannot hold it)
    "é ü ß 日本語 😀",
    "\u2028\u2029\ufeff\uffff\U0010ffff",
    'a "quoted" \\ back\\slash',
    '{"not": "json"}',
    "x" * 10_000,
]
DETAILS = [
    None,
    "null",
    "true",
    "0",
    "-0",
    "1.0",
    "1e400",
    "-12345678901234567890.000000000000000001",
    '"text with \\n, \\u0001 and \\u00e9"',
    "[]",
    "{}",
    '{"b": 1, "a": [1, {"y": null, "x": "\\u00e9"}], "aa": 2, "": "", "ab": [[], {}]}',
    '{"a": 1, "a": 2}',
    json.dumps({"k" * n: list(range(n)) for n in range(1, 12)}),
    json.dumps([[[[[["deep"]]]]]]),
    json.dumps({"tool": "echo", "ttl_ms": 60000, "reason": "cap_exceeded", "limit": 16}),
]
TIMES = [
    "1970-01-01 00:00:00+00",
    "2026-12-06 12:00:00+00",
    "2026-12-06 12:00:00.000001+00",
    "2026-12-06 12:00:00.999999+05:30",
    "1999-12-31 23:59:59.5-11",
    "9999-12-31 23:59:59.999999+00",
    "0001-01-01 00:00:00+00",
    "0044-03-15 12:00:00+00 BC",
    "294276-12-31 23:59:59+00",
    "infinity",
    "-infinity",
    None,
]
SEQS = [1, 2, 1_000_000, 9_223_372_036_854_775_807, 0, -1, -9_223_372_036_854_775_808, None]


def event(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "tenant_id": "acme", "seq": 1, "at": "2026-12-06 12:00:00+00", "action": "create", "outcome": "working",
        "subject": "alice", "client_id": "client", "issuer": "https://issuer.example", "task_id": "task-1",
        "request_id": "7", "client_address": "127.0.0.1", "detail": None,
    }  # fmt: skip
    return {**base, **fields}


def edge_cases() -> list[dict[str, Any]]:
    """Each field's awkward values, one field at a time, and NULL in every field."""
    cases = [event()]
    for name in TEXT_FIELDS:
        cases += [event(**{name: value}) for value in [*AWKWARD, None]]
    cases += [event(detail=d) for d in DETAILS]
    cases += [event(at=t) for t in TIMES]
    cases += [event(seq=s) for s in SEQS]
    cases.append({name: None for name in event()})
    return cases


async def canonical_texts(conn: asyncpg.Connection, events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(new text, old text) of every event, in order."""
    rows = await conn.fetch(COMPARE, *([e[name] for e in events] for name in event()))
    assert [r["o"] for r in rows] == list(range(1, len(events) + 1))
    return [(r["got"], r["want"]) for r in rows]


def differing(events: list[dict[str, Any]], texts: list[tuple[str, str]]) -> list[tuple[dict[str, Any], str, str]]:
    return [(e, got, want) for e, (got, want) in zip(events, texts, strict=True) if got != want]


# Session settings that change how times and numbers are written elsewhere, and how a function's
# body is compiled (standard_conforming_strings): none may change the text.
ODD_SETTINGS = {
    "DateStyle": "Postgres, DMY",
    "TimeZone": "Asia/Kathmandu",
    "extra_float_digits": "-15",
    "standard_conforming_strings": "off",
}


async def test_the_canonical_text_is_the_jsonb_objects_for_every_fields_edge_cases_T_SEC_10(database_url: str) -> None:
    cases = edge_cases()
    for server_settings in ({}, ODD_SETTINGS):
        conn = await asyncpg.connect(database_url, server_settings=server_settings)
        try:
            texts = await canonical_texts(conn, cases)
        finally:
            await conn.close()
        assert differing(cases, texts) == []
        # The cases reach what they are for: escapes, non-ASCII text, nested details, NULLs.
        new = [got for got, _ in texts]
        assert any('\\"' in t for t in new)
        assert any("\\u0001" in t for t in new)
        assert any("😀" in t for t in new)
        assert any('"detail": {"a": 2}' in t for t in new)
        assert any('"detail": [[[[[["deep"]]]]]]' in t for t in new)
        assert sum('"at": null' in t for t in new) >= 2  # NULL, and a time to_char cannot write
        assert new[-1].startswith('{"at": null, "seq": null, "action": null, "detail": null, "issuer": null')


# Generated events: any text but NUL and lone surrogates, any JSON for the detail.
any_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
events = st.fixed_dictionaries(
    {name: st.none() | any_text for name in TEXT_FIELDS}
    | {
        "seq": st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1),
        "at": st.none() | st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat(sep=" ")),
        "detail": st.none() | json_values.map(json.dumps),
    }
)


async def test_the_canonical_text_is_the_jsonb_objects_for_generated_events_T_SEC_10(database_url: str) -> None:
    generated: list[dict[str, Any]] = []

    @settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(e=events)
    def collect(e: dict[str, Any]) -> None:
        generated.append(e)

    collect()
    conn = await asyncpg.connect(database_url)
    try:
        texts = await canonical_texts(conn, generated)
    finally:
        await conn.close()
    assert len(texts) == 1500
    assert differing(generated, texts) == []
