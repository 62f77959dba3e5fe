"""The app in-process over a deterministic fake engine: paths a real model cannot reach on cue
(a full queue, a closing engine, a crash mid-stream) and the app's own bookkeeping."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fake_engine import FakeEngine
from starlette.testclient import TestClient

from pagedkv.server.app import ServerState, create_app
from pagedkv.server.serve import load_api_keys

USER = [{"role": "user", "content": "hello there"}]


def make_client(engine: FakeEngine | None = None, **kwargs: Any) -> TestClient:
    return TestClient(create_app(engine or FakeEngine(), **kwargs), raise_server_exceptions=False)


def sse_events(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_full_queue_is_429_with_retry_after_for_plain_and_streaming_requests() -> None:
    client = make_client(FakeEngine(max_queue=0))
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0
        ).completions.create(model="fake-model", prompt="x")


def test_a_closed_engine_and_a_closing_server_answer_503() -> None:
    engine = FakeEngine()
    client = make_client(engine)
    engine.close()
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "engine_unavailable"

    client = make_client()
    state: ServerState = client.app.state.pagedkv  # type: ignore[attr-defined]
    state.closing = True
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert client.get("/health").status_code == 503


def test_a_bug_becomes_a_json_500_and_an_error_mid_stream_ends_the_stream() -> None:
    class Broken(FakeEngine):
        def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
            raise RuntimeError("tokenizer bug")

    r = make_client(Broken()).post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"

    class DiesMidStream(FakeEngine):
        def _run(self, *args: Any) -> Iterator[Any]:
            inner = super()._run(*args)
            yield next(inner)
            inner.close()
            raise RuntimeError("worker died")

    r = make_client(DiesMidStream()).post(
        "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 5}
    )
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"].startswith("internal error: RuntimeError (request id")
    assert events[0]["choices"][0]["text"]


def test_sampling_fields_reach_the_engine() -> None:
    engine = FakeEngine()
    client = make_client(engine)
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "top_p": 0})
    client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "top_k": -1,
            "temperature": 0.5,
            "seed": 3,
            "stop": "q",
            "ignore_eos": True,
        },
    )
    client.post("/v1/completions", json={"prompt": "x", "temperature": 1e-300, "top_p": 0.5})
    client.post(
        "/v1/chat/completions",
        json={
            "max_completion_tokens": 4,
            "max_tokens": 9,
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
        },
    )
    greedy, sampled, tiny_temperature, chat = (c["params"] for c in engine.calls)
    assert (greedy.temperature, greedy.top_p, greedy.max_tokens) == (0.0, 1.0, 3)
    assert (sampled.temperature, sampled.top_k, sampled.seed, sampled.stop) == (0.5, 0, 3, ("q",))
    assert sampled.ignore_eos and sampled.max_tokens == 256 - 1  # the context left
    assert tiny_temperature.temperature == 0.0  # 1e-300 would overflow the sampler
    assert chat.max_tokens == 4
    assert engine.calls[3]["ids"] == engine.apply_chat_template(
        [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    )


def test_tenant_salts() -> None:
    engine = FakeEngine()
    client = make_client(engine, api_keys=["key-a", "key-b"])

    def salt(key: str, **fields: Any) -> str | None:
        r = client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, **fields},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200
        return engine.calls[-1]["cache_salt"]

    a, b = salt("key-a"), salt("key-b")
    assert a and b and a != b and salt("key-a") == a
    narrowed = salt("key-a", cache_salt="proj")
    assert narrowed is not None and narrowed.startswith(a) and narrowed != a
    assert salt("key-b", cache_salt="proj") != narrowed
    assert "key-a" not in a  # derived from the key, never the key itself

    engine = FakeEngine()
    open_client = make_client(engine)
    open_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": "s"})
    assert engine.calls[-1]["cache_salt"] == "s"  # no keys: one tenant, request salt as is


def test_admin_keys() -> None:
    engine = FakeEngine()
    engine.generate("hello there")
    no_admin = make_client(engine, api_keys=["a", "b"])
    r = no_admin.post("/v1/cache/clear", headers={"Authorization": "Bearer b"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert engine.cleared == 0 and engine.cache  # tenant B cleared nothing
    listed = make_client(engine, api_keys=["a"], admin_keys=["root"])
    r = listed.post("/v1/cache/clear", headers={"Authorization": "Bearer a"})
    assert r.status_code == 403 and engine.cleared == 0
    r = listed.post("/v1/cache/clear", headers={"Authorization": "Bearer root"})
    assert r.status_code == 200 and engine.cleared == 1 and not engine.cache
    assert make_client(engine).post("/v1/cache/clear").status_code == 200  # single-user
    assert engine.cleared == 2
    assert listed.post("/v1/cache/clear").status_code == 401


def test_streaming_format_and_logprobs() -> None:
    client = make_client()
    r = client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "stream": True, "logprobs": 0, "temperature": 0},
    )
    events = sse_events(r.text)
    assert r.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    pieces = [e["choices"][0] for e in events[:-1]]
    assert [p["finish_reason"] for p in pieces] == [None] * 4 + ["length"]
    lp = [p["logprobs"] for p in pieces[:4]]
    assert [x["tokens"][0] for x in lp] == [p["text"] for p in pieces[:4]]
    assert [x["text_offset"][0] for x in lp] == [0, 1, 2, 3]
    assert "usage" not in events[0]  # only with stream_options.include_usage

    r = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 3, "logprobs": True, "temperature": 0},
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [0.0, -0.25, -0.5]
    assert "".join(c["token"] for c in content) == r.json()["choices"][0]["message"]["content"]


def test_shutdown_cancel_ends_a_stream_cleanly_and_releases_blocks() -> None:
    engine = FakeEngine(token_delay=0.01)
    client = make_client(engine)
    state: ServerState = client.app.state.pagedkv  # type: ignore[attr-defined]
    got: list[str] = []
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 200, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line:
                got.append(line)
            if len(got) == 3:
                assert state.cancel_all() == 1
    assert got[-1] == "data: [DONE]"
    assert json.loads(got[-2][6:])["error"]["code"] == "request_cancelled"
    assert len(got) < 100
    deadline = time.monotonic() + 5
    while engine.allocated or engine.active:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not state.generations


def test_metrics_are_per_app_and_cover_tiers_pool_and_requests() -> None:
    one, two = make_client(), make_client()
    one.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
    one.post("/v1/chat/completions", json={"messages": "nope"})
    samples = metric_samples(one.get("/metrics").text)
    chat = "/v1/chat/completions"
    assert samples[("pagedkv_http_requests_total", (("endpoint", chat), ("status", "200")))] == 1
    assert samples[("pagedkv_http_requests_total", (("endpoint", chat), ("status", "400")))] == 1
    assert samples[("pagedkv_generation_tokens_total", ())] == 3
    assert samples[("pagedkv_cache_tier_writes_dropped_total", (("tier", "ssd"),))] == 3
    assert samples[("pagedkv_pool_blocks", (("state", "allocated"),))] == 0
    assert samples[("pagedkv_pool_max_blocks", ())] == 64
    assert samples[("pagedkv_requests_in_flight", ())] == 0
    assert ("pagedkv_cache_tier_hits_total", (("tier", "redis"),)) not in samples  # not configured
    other = metric_samples(two.get("/metrics").text)
    assert other[("pagedkv_generation_tokens_total", ())] == 0
    one.get("/no/such/path")
    samples = metric_samples(one.get("/metrics").text)
    assert samples[("pagedkv_http_requests_total", (("endpoint", "other"), ("status", "404")))] == 1


def test_concurrent_requests_over_one_app() -> None:
    engine = FakeEngine(token_delay=0.002)
    client = make_client(engine)
    results: list[int] = []

    def one(i: int) -> None:
        r = client.post(
            "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 10, "stream": i % 2 == 0}
        )
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    assert engine.allocated == 0 and engine.active == 0


def test_api_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-one\n\n  key-two  \n")
    keys.chmod(0o600)
    assert load_api_keys(keys) == ["key-one", "key-two"]
    keys.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no keys"):
        load_api_keys(keys)
    with pytest.raises(OSError, match="cannot read the API keys file"):
        load_api_keys(tmp_path / "missing")
