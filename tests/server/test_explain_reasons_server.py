"""Explain's causes through real server subprocesses, on both explain routes: another
tenant's prefix (told to the admin key only), a model served with another KV dtype on
the same SSD directory, a chat template that prints the time, a recurrent hybrid
model's block and snapshot boundaries (explain's cached tokens equal the request's);
and the Prometheus counter of misses by reason."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_models import TINY_CHAT_TEMPLATE, make_tiny_model
from server_proc import ServerProc, running, start_server, tools_model_dir

from pagedkv.cache.explain import REASONS

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

KEY_A, KEY_B, ADMIN = "key-a", "key-b", "admin-key"


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tools_model_dir, api_keys=[KEY_A, KEY_B], admin_keys=[ADMIN]))


def post(server: ServerProc, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.http(key) as http:
        r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def conversation(tag: str, question: str) -> list[dict[str, str]]:
    system = f"[{tag}] You answer questions about caches, blocks, hashes and the quick brown fox."
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_other_tenant_is_told_to_the_admin_only(server: ServerProc) -> None:
    messages = conversation(uuid.uuid4().hex, "Who else asked this?")
    post(server, KEY_A, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    admin = post(server, ADMIN, "/v1/cache/explain", {"messages": messages})
    assert admin["miss"]["reason"] == "other_tenant" and admin["cached_tokens"] == 0
    assert admin["miss"]["section"]["kind"] == "system"
    assert "key1" not in admin["miss"]["detail"] and KEY_A not in admin["miss"]["detail"]
    # Another tenant learns nothing: new, as if nobody had sent it.
    other = post(server, KEY_B, "/v1/cache/explain", {"messages": messages})
    assert other["miss"]["reason"] == "new" and other["miss"]["token_index"] == 0
    # The Messages route says the same to the admin.
    body = {
        "system": messages[0]["content"],
        "messages": messages[1:],
        "max_tokens": 4,
        "model": "tiny",
    }
    post(server, KEY_A, "/v1/messages", body)
    told = post(server, ADMIN, "/v1/messages/explain", body)
    assert told["miss"]["reason"] == "other_tenant"
    assert told["miss"]["section"] == {"kind": "system", "message_index": None, "role": "system"}
    assert post(server, KEY_B, "/v1/messages/explain", body)["miss"]["reason"] == "new"


def test_the_counter_has_every_reason_and_counts_explain_answers(server: ServerProc) -> None:
    def scrape() -> dict[str, float]:
        with server.http(ADMIN) as http:
            text = http.get("/metrics").text
        pattern = r'pagedkv_explain_misses_total\{reason="(\w+)",source="explain"\} (\S+)'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text)}

    before = scrape()
    assert set(before) == set(REASONS)  # lease_expired and reasoning_stripped included
    with server.http(ADMIN) as http:
        text = http.get("/metrics").text
    for reason in REASONS:  # the requests' series too (counted at --log-level debug)
        assert f'pagedkv_explain_misses_total{{reason="{reason}",source="request"}}' in text
    messages = conversation(uuid.uuid4().hex, "Count me.")
    reasons = [
        post(server, key, "/v1/cache/explain", {"messages": messages})["miss"]["reason"]
        for key in (KEY_A, KEY_B, ADMIN)
    ]
    after = scrape()
    for reason in set(reasons):
        assert after[reason] == before[reason] + reasons.count(reason)
    assert sum(after.values()) == sum(before.values()) + 3


def test_another_kv_dtype_on_the_same_ssd_is_identity_changed(
    tools_model_dir: Path, tmp_path: Path
) -> None:
    messages = conversation(uuid.uuid4().hex, "Was this computed by another model?")
    ssd = ["--ssd-cache-dir", str(tmp_path / "kv")]
    for first in running(start_server(tools_model_dir, api_keys=[KEY_A], args=ssd)):
        post(first, KEY_A, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    args = [*ssd, "--kv-dtype", "int8"]
    for second in running(start_server(tools_model_dir, api_keys=[KEY_A], args=args)):
        exp = post(second, KEY_A, "/v1/cache/explain", {"messages": messages})
        assert exp["miss"]["reason"] == "identity_changed" and exp["cached_tokens"] == 0
        assert "kv_dtype" in exp["miss"]["detail"] and "ssd" in exp["miss"]["detail"]
        body = {
            "system": messages[0]["content"],
            "messages": messages[1:],
            "max_tokens": 4,
            "model": "tiny",
        }
        assert post(second, KEY_A, "/v1/messages/explain", body)["miss"]["reason"] in (
            "identity_changed",
            "new",  # the Messages form renders the same system turn: same tokens
        )
        done = post(second, KEY_A, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


TIMED_TEMPLATE = (
    "{{ '<|im_start|>system\\nNow: ' + strftime_now('%H:%M:%S') + '<|im_end|>\\n' }}"
    + TINY_CHAT_TEMPLATE
)


def _start_of_a_second() -> None:
    """Sleep into the next second, so the renders of one call fall in one second."""
    time.sleep(1.02 - time.time() % 1.0)


def test_a_template_that_prints_the_time_is_template_drift(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "timed", arch="llama", chat_template=TIMED_TEMPLATE)
    messages = conversation(uuid.uuid4().hex, "Same words, other tokens?")
    for server in running(start_server(model, api_keys=[KEY_A, KEY_B])):
        _start_of_a_second()
        post(server, KEY_A, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        _start_of_a_second()
        exp = post(server, KEY_A, "/v1/cache/explain", {"messages": messages})
        assert exp["miss"]["reason"] == "template_drift", exp
        assert "rendered them to other tokens" in exp["miss"]["detail"]
        assert exp["miss"]["section"]["message_index"] == 0
        # Another key never sent these messages: its memory is its own.
        _start_of_a_second()
        other = post(server, KEY_B, "/v1/cache/explain", {"messages": messages})
        assert other["miss"]["reason"] == "new"
        # Other messages than the ones sent: not the template's doing.
        _start_of_a_second()
        changed = [messages[0], {"role": "user", "content": "Something else entirely."}]
        assert post(server, KEY_A, "/v1/cache/explain", {"messages": changed})["miss"][
            "reason"
        ] in ("diverged", "template_drift")
        # Anthropic clients get the same cause.
        _start_of_a_second()
        body = {"system": messages[0]["content"], "messages": messages[1:], "max_tokens": 4}
        told = post(server, KEY_A, "/v1/messages/explain", {**body, "model": "timed"})
        assert told["miss"]["reason"] == "template_drift"


BS_HYBRID = 16


def test_hybrid_block_and_snapshot_boundaries(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "lfm2", arch="lfm2", seed=5, max_position_embeddings=1024)
    args = ["--block-size", str(BS_HYBRID), "--snapshot-interval-blocks", "4"]
    # ~100 shared tokens with the second question: KV of 6 blocks, a snapshot at 4.
    system = {"role": "system", "content": "Alpha: " + "caches keep blocks of tokens. " * 9}
    first = [system, {"role": "user", "content": "What is a block?"}]
    for server in running(start_server(model, args=args)):
        post(server, "none", "/v1/chat/completions", {"messages": first, "max_tokens": 2})
        seen: set[str] = set()
        # A system prompt that shares only its first tokens (fewer than a block), then
        # the same system prompt with another question (more blocks than a snapshot).
        short = [{"role": "system", "content": "Beta."}, first[1]]
        long = [system, {"role": "user", "content": "And what is a snapshot?"}]
        for messages in (short, long):
            exp = post(server, "none", "/v1/cache/explain", {"messages": messages})
            done = post(
                server, "none", "/v1/chat/completions", {"messages": messages, "max_tokens": 2}
            )
            reused = done["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert exp["cached_tokens"] == reused, (exp, done["usage"])
            assert exp["cached_tokens"] % (4 * BS_HYBRID) == 0
            seen.add(exp["miss"]["reason"])
        assert seen == {"below_block", "snapshot_missing"}, seen
