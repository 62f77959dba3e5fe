"""Sampled requests with n >= 2 and a seed near 2**64 against a real server: each is
answered, and more of them than `--max-queue` leave every slot free for the next
request (they used to get a 400 and keep a slot and its KV forever)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_proc import ServerProc, running, small_context_model_dir, start_server

pytestmark = pytest.mark.slow
__all__ = ["small_context_model_dir"]  # a fixture, used by name

KEY = "k-seeds"
MAX_QUEUE = 2
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(small_context_model_dir: Path) -> Iterator[ServerProc]:
    proc = start_server(
        small_context_model_dir, api_keys=[KEY], args=["--max-queue", str(MAX_QUEUE)]
    )
    yield from running(proc)


def test_huge_seeds_with_n_leave_no_slot_held(server: ServerProc) -> None:
    with server.http(KEY) as http:
        for seed in (2**64 - 1, 2**64 - 2, 2**64 - 1, -1):  # more than --max-queue
            body = {"messages": USER, "max_tokens": 2, "n": 3, "temperature": 1.0, "seed": seed}
            r = http.post(CHAT, json=body)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 3
        r = http.post(CHAT, json={"messages": USER, "max_tokens": 2, "n": 3, "seed": 2**64})
        assert r.status_code == 400, r.text  # outside what a seed can be: refused, and
        normal = http.post(CHAT, json={"messages": USER, "max_tokens": 2})
        assert normal.status_code == 200, normal.text  # nothing was kept by any of them
