"""Reasoning-aware storing: cache each turn in the form the next request will send it.

Templates of reasoning models (Qwen3's, and others) drop `<think>...</think>`
from assistant turns once a newer user message follows. The KV a turn cached
(prompt, then the generated reasoning and answer) then stops being a prefix of
the next prompt right where the reasoning began, and the next turn recomputes
the answer. When that is so, the engine also stores the next prompt's form of
the finished turn: the conversation, this turn's answer included, rendered
through the model's own template up to where the next message's content starts.
Computing it costs one prefill of the answer (and of every reasoning-free turn
since the last user message), run as a background prefill-only request
(`Engine.prewarm_stream(background=True)`): it waits behind every client
request and prefills after them, so it runs in the client's think or tool time.
Rejected: doing it lazily at the next request, which is what happens without
this (the next request recomputes the same tokens before its first one); see
docs/benchmarks.md for the measured TTFT of both.

The decision is per template, by a render test at load (`template_strips`): a
probe conversation whose earlier assistant turn reasons, then a new user
message; if the probe's reasoning text is missing from the rendering, the
template strips reasoning. `CacheConfig.reasoning_cache` ("auto", "on", "off",
`--reasoning-cache`) overrides it. When the template keeps the reasoning, the
next prompt's form of a turn is what was cached already, so nothing changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

REASONING_MODES = ("auto", "on", "off")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = "pagedkv probe reasoning zq"

Render = Callable[[list[dict[str, Any]]], list[int]]


@dataclass(frozen=True, slots=True)
class ReasoningPolicy:
    """Whether finished turns are also stored in the next prompt's form: `mode` as
    configured, `strips` what the render test found (None: the template could not
    render the probe, or there is none), `active` the outcome."""

    mode: str
    strips: bool | None
    active: bool

    def describe(self) -> str:
        found = {True: "strips reasoning", False: "keeps reasoning", None: "untested"}
        state = "on" if self.active else "off"
        return f"{state} (--reasoning-cache {self.mode}; template {found[self.strips]})"


def template_strips(render: Render, decode: Callable[[Sequence[int]], str]) -> bool | None:
    """Render a probe conversation whose first assistant turn reasons, then a new user
    message: True when the reasoning text is gone, False when it is kept, None when the
    template refuses the probe."""
    messages = [
        {"role": "user", "content": "Question one."},
        {"role": "assistant", "content": f"{THINK_OPEN}\n{_PROBE}\n{THINK_CLOSE}\n\nAnswer one."},
        {"role": "user", "content": "Question two."},
    ]
    try:
        text = decode(render(messages))
    except Exception:  # a template that refuses these messages: no finding
        log.debug("the reasoning render test could not render its probe", exc_info=True)
        return None
    return _PROBE not in text


def policy(
    mode: str, render: Render | None, decode: Callable[[Sequence[int]], str]
) -> ReasoningPolicy:
    """The policy for `mode` and the model's template (`render`; None: no template)."""
    if mode not in REASONING_MODES:
        raise ValueError(
            f"reasoning_cache must be one of {', '.join(REASONING_MODES)}, got {mode!r}"
        )
    strips = template_strips(render, decode) if render is not None else None
    active = mode == "on" or (mode == "auto" and strips is True)
    return ReasoningPolicy(mode, strips, active and render is not None)


def next_turn_ids(render: Render, messages: Sequence[dict[str, Any]], follow: str) -> list[int]:
    """Token ids of `messages` (the turn's answer last) as the next request will start:
    rendered with a next message of role `follow` ("user", or "tool" after a tool call),
    up to where that message's content begins. Two probes with different contents are
    rendered; their common prefix is the part that does not depend on the content."""
    probes = []
    for content in ("0", "1"):
        extra: dict[str, Any] = {"role": follow, "content": content}
        if follow == "tool":
            extra["tool_call_id"] = "call_0"
        probes.append(render([*messages, extra]))
    a, b = probes
    return a[: common_prefix(a, b)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share (one vectorized compare, not a loop: it
    runs over whole conversations after every turn)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True, slots=True)
class NextTurn:
    """What `Engine.store_next_turn` did: the next prompt's form of the turn has
    `num_tokens`, of which the first `shared_tokens` are what the turn computed;
    `submitted` when a background prefill of the rest was queued."""

    num_tokens: int
    shared_tokens: int
    submitted: bool
