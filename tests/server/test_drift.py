"""The render memory behind explain's `template_drift`: it finds the same messages
rendered to other tokens, for the same salt only, keeps no token, and stays bounded."""

from __future__ import annotations

import dataclasses

from pagedkv.server.drift import STRIDE, RenderMemory, _Render

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is a block?"}


def prompt(date: int, n: int = 5 * STRIDE) -> list[int]:
    """A render whose token 2 * STRIDE + 3 carries a date the template prints."""
    ids = list(range(10, 10 + n))
    ids[2 * STRIDE + 3] = date
    return ids


def test_same_messages_other_tokens_is_drift_at_the_stride_that_differs() -> None:
    memory = RenderMemory()
    memory.remember("salt-a", [SYSTEM, USER], None, prompt(1))
    ids = prompt(2)
    found = memory.drift("salt-a", [SYSTEM, USER], None, ids, 1, len(ids), 2 * STRIDE + 3)
    assert found is not None and found.start == 2 * STRIDE
    # The same render again: no drift.
    same = prompt(1)
    assert memory.drift("salt-a", [SYSTEM, USER], None, same, 1, len(same), 2 * STRIDE + 3) is None


def test_other_messages_tools_or_salt_are_no_drift() -> None:
    memory = RenderMemory()
    memory.remember("salt-a", [SYSTEM, USER], None, prompt(1))
    ids, at = prompt(2), 2 * STRIDE + 3
    other_user = {"role": "user", "content": "What is a hash?"}
    assert memory.drift("salt-a", [SYSTEM, other_user], None, ids, 1, len(ids), at) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert memory.drift("salt-a", [SYSTEM, USER], tools, ids, 1, len(ids), at) is None
    assert memory.drift("salt-b", [SYSTEM, USER], None, ids, 1, len(ids), at) is None
    assert memory.drift(None, [SYSTEM, USER], None, ids, 1, len(ids), at) is None
    # The first message alone was sent before too: drift there as well.
    assert memory.drift("salt-a", [SYSTEM], None, ids, 0, len(ids), at) is not None
    # A miss before the stride that differs is not the drift's doing.
    assert memory.drift("salt-a", [SYSTEM, USER], None, ids, 1, len(ids), STRIDE) is None


def test_bounded_per_owner_and_in_bytes_and_holds_digests_only() -> None:
    memory = RenderMemory(per_owner=2, max_bytes=4000)
    for i in range(50):
        memory.remember(f"salt-{i}", [SYSTEM, USER], None, prompt(i, 40 * STRIDE))
        assert memory.bytes_used <= 4000
    assert len(memory._owners) < 50
    ids = prompt(0, 40 * STRIDE)
    # The oldest owners are forgotten first.
    assert memory.drift("salt-0", [SYSTEM, USER], None, ids, 1, len(ids), 200) is None
    assert memory.drift("salt-49", [SYSTEM, USER], None, ids, 1, len(ids), 200) is not None
    for i in range(3):
        memory.remember("one", [SYSTEM, USER], None, prompt(i))
    assert len(memory._owners["one"]) == 2
    # A render is two tuples of 64-bit digests: no field can hold a token list.
    assert [f.name for f in dataclasses.fields(_Render)] == ["messages", "prefixes"]
    render = memory._owners["one"][-1]
    assert all(isinstance(d, int) and d >= 2**16 for d in render.prefixes[:3])
