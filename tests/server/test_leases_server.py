"""Leases through a real server subprocess: Anthropic `cache_control`, OpenAI
`prompt_cache_retention`, the usage each API reports, the admin's list and drop,
tenant isolation, a lease surviving a flood, and `lease_expired` through explain."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, running, start_server, tools_model_dir

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

A, B, ADMIN = "lease-key-a", "lease-key-b", "lease-admin"
RAM = "256KB"  # a small RAM tier, so a flood evicts


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(
        start_server(
            tools_model_dir, api_keys=[A, B], admin_keys=[ADMIN], args=["--ram-cache", RAM]
        )
    )


def call(server: ServerProc, key: str, method: str, path: str, body: Any = None) -> Any:
    with server.http(key) as http:
        r = http.request(method, path, json=body)
    return r


def ok(server: ServerProc, key: str, method: str, path: str, body: Any = None) -> Any:
    r = call(server, key, method, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def system_prefix(tag: str) -> str:
    return f"[{tag}] You are an agent. " + "Follow the house rules about caches. " * 3


def messages_body(tag: str, question: str, control: Any = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": system_prefix(tag)}
    block["cache_control"] = control if control is not None else {"type": "ephemeral"}
    return {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0.0,
        "system": [block],
        "messages": [{"role": "user", "content": question}],
    }


def leases(server: ServerProc, key: str = ADMIN) -> list[dict[str, Any]]:
    return list(ok(server, key, "GET", "/v1/cache/leases")["data"])


def flood(server: ServerProc, rounds: int) -> None:
    """Unrelated prompts of another tenant, many times the RAM tier."""
    for _ in range(rounds):
        text = f"{uuid.uuid4().hex} " + "unrelated traffic fills the cache " * 2
        body = {"model": "tiny", "max_tokens": 1, "prompt": text, "temperature": 0.0}
        ok(server, B, "POST", "/v1/completions", body)


def ram_blocks(server: ServerProc) -> int:
    return int(ok(server, ADMIN, "GET", "/v1/cache/stats")["pool"]["max_blocks"])


def test_cache_control_leases_the_prefix_and_usage_splits_creation_from_reads(
    server: ServerProc,
) -> None:
    tag = uuid.uuid4().hex
    first = ok(server, A, "POST", "/v1/messages", messages_body(tag, "What is a block?"))
    u = first["usage"]
    assert u["cache_read_input_tokens"] == 0 and u["cache_creation_input_tokens"] > 0
    mine = [lease for lease in leases(server, A)]
    assert len(mine) == 1 and mine[0]["ttl_s"] == 300.0 and mine[0]["tenant"] == "key1"
    assert mine[0]["num_tokens"] == u["cache_creation_input_tokens"]
    second = ok(server, A, "POST", "/v1/messages", messages_body(tag, "And a hash?"))
    v = second["usage"]
    assert v["cache_read_input_tokens"] >= u["cache_creation_input_tokens"]
    assert v["cache_creation_input_tokens"] == 0
    counted = messages_body(tag, "And a hash?")
    del counted["max_tokens"], counted["temperature"]
    total = ok(server, A, "POST", "/v1/messages/count_tokens", counted)["input_tokens"]
    assert v["input_tokens"] + v["cache_read_input_tokens"] == total
    (renewed,) = [x for x in leases(server, A) if x["id"] == mine[0]["id"]]
    assert renewed["renewals"] >= 1
    assert ok(server, ADMIN, "DELETE", f"/v1/cache/leases/{mine[0]['id']}")["dropped"]


@pytest.mark.parametrize(
    ("control", "param"),
    [
        ({"type": "ephemeral", "ttl": "2h"}, "system[0].cache_control.ttl"),
        ({"type": "persistent"}, "system[0].cache_control.type"),
        ({"type": "ephemeral", "scope": "x"}, "system[0].cache_control.scope"),
    ],
)
def test_a_cache_control_that_cannot_be_honoured_is_a_400_naming_it(
    server: ServerProc, control: Any, param: str
) -> None:
    r = call(server, A, "POST", "/v1/messages", messages_body("x", "hi", control))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(param)


def test_one_hour_ttl_and_tenant_isolation_of_the_admin_routes(server: ServerProc) -> None:
    body = messages_body(uuid.uuid4().hex, "hi", {"type": "ephemeral", "ttl": "1h"})
    ok(server, A, "POST", "/v1/messages", body)
    mine = [x for x in leases(server, A) if x["ttl_s"] == 3600.0]
    assert len(mine) == 1
    assert all(x["tenant"] == "key2" for x in leases(server, B))  # B sees none of A's
    assert mine[0]["id"] in {x["id"] for x in leases(server, ADMIN)}
    r = call(server, B, "DELETE", f"/v1/cache/leases/{mine[0]['id']}")
    assert r.status_code == 403
    assert call(server, ADMIN, "DELETE", "/v1/cache/leases/lease_nope").status_code == 404
    ok(server, ADMIN, "DELETE", f"/v1/cache/leases/{mine[0]['id']}")
    assert mine[0]["id"] not in {x["id"] for x in leases(server, ADMIN)}


def test_prompt_cache_retention_leases_the_chat_prompt_and_reports_cached_tokens(
    server: ServerProc,
) -> None:
    def body(tag: str) -> dict[str, Any]:
        messages = [{"role": "system", "content": system_prefix(tag)}]
        messages.append({"role": "user", "content": "q"})
        return {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0.0}

    for retention, ttl, tiers in (("24h", 86400.0, 3), ("in_memory", 300.0, 1)):
        tag = uuid.uuid4().hex
        sent = {**body(tag), "prompt_cache_retention": retention, "prompt_cache_key": tag}
        first = ok(server, A, "POST", "/v1/chat/completions", sent)
        (lease,) = [x for x in leases(server, A) if x["prompt_cache_key"] == tag]
        assert lease["ttl_s"] == ttl and len(lease["tiers"]) == tiers
        assert lease["num_tokens"] > 0
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < lease["num_tokens"]
        second = ok(server, A, "POST", "/v1/chat/completions", sent)
        reusable = min(lease["num_tokens"], second["usage"]["prompt_tokens"] - 1)  # last: computed
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= reusable
        ok(server, ADMIN, "DELETE", f"/v1/cache/leases/{lease['id']}")
    r = call(
        server, A, "POST", "/v1/chat/completions", {**body("x"), "prompt_cache_retention": "1y"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"


def test_a_lease_survives_a_flood_and_a_lapsed_one_is_explained_as_lease_expired(
    server: ServerProc,
) -> None:
    for lease in leases(server):
        ok(server, ADMIN, "DELETE", f"/v1/cache/leases/{lease['id']}")
    tag = uuid.uuid4().hex
    first = ok(server, A, "POST", "/v1/messages", messages_body(tag, "What is a block?"))
    leased = first["usage"]["cache_creation_input_tokens"]
    assert leased > 0
    rounds = ram_blocks(server) // 2  # each prompt ~6 blocks: the tier, 3 times over
    flood(server, rounds)
    again = messages_body(tag, "What is a block?")
    explained = ok(server, A, "POST", "/v1/messages/explain", again)
    assert explained["cached_tokens"] >= leased
    (lease,) = leases(server)
    ok(server, ADMIN, "DELETE", f"/v1/cache/leases/{lease['id']}")
    flood(server, rounds)
    explained = ok(server, A, "POST", "/v1/messages/explain", again)
    assert explained["cached_tokens"] < leased
    assert explained["miss"]["reason"] == "lease_expired", explained
    assert "lease lapsed" in explained["miss"]["detail"]
