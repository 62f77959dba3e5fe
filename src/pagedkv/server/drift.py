"""Template drift: the same messages rendered to other tokens than the last time this
client sent them, which no cache can survive (explain's `template_drift`).

Typical causes: a chat template that prints the date or time (Llama 3's "Today
Date"), a server restarted under another template, tool definitions the template
orders differently. The client sent nothing new, so "diverged" would blame it.

`RenderMemory` keeps, per cache salt (a key, or a key and its request
`cache_salt`), its last `per_owner` generating requests as two lists of 8-byte
digests, never tokens or text:
- cumulative digests of the tools and of `messages[:k]` for every k (each message
  as canonical JSON), which say "these first k messages were sent before";
- cumulative digests of the rendered prompt every `STRIDE` tokens, which say
  whether that earlier render agreed with this one up to a position.
A miss in message k of a prompt whose first k + 1 messages (and tools) equal a
remembered request's is template drift when that request's render already
disagreed with this one at or before the stride holding the miss: same input,
other tokens, by the template's doing.

Costs: per generating request one canonical JSON of its messages and one xxh3 pass
over its tokens (microseconds per thousand tokens), on the render pool's thread;
0.5 bytes per prompt token (up to `MAX_TOKENS` of it) plus 8 per message, at most
`max_bytes` in all, the least recently active owner forgotten first. Explain adds
one comparison of digest lists.

Leaks nothing across tenants: a memory is read only with the salt it was written
under, and it holds digests of that salt's own requests; what explain says is
that this client's own earlier request rendered differently, and where. The
digests are unseeded xxh3 of data the owner sent, so they tell the server's
memory nothing it did not already see.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from pagedkv.model.images import ImageInput

STRIDE = 16
MAX_TOKENS = 1 << 16


@dataclass(frozen=True, slots=True)
class _Render:
    messages: tuple[int, ...]  # [tools digest, then after each message]
    prefixes: tuple[int, ...]  # after every STRIDE tokens of the prompt

    @property
    def nbytes(self) -> int:
        return 8 * (len(self.messages) + len(self.prefixes)) + 120


def _stable(value: object) -> str:
    """JSON for what json cannot write: an image by its pixels' digest (its repr names
    a memory address, so the same image sent twice would never compare equal)."""
    if isinstance(value, ImageInput):
        return "image:" + value.digest.hex()
    return str(value)


def message_digests(messages: Sequence[dict[str, Any]], tools: Any) -> tuple[int, ...]:
    """Cumulative digests: of the tools, then of the tools and messages[:k], k >= 1."""
    h = xxhash.xxh3_64_intdigest(json.dumps(tools, sort_keys=True, default=_stable).encode())
    out = [h]
    for m in messages:
        raw = json.dumps(m, sort_keys=True, default=_stable).encode()
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + raw)
        out.append(h)
    return tuple(out)


def prefix_digests(ids: Sequence[int]) -> tuple[int, ...]:
    """Cumulative digests of the prompt after every STRIDE tokens (up to MAX_TOKENS)."""
    n = min(len(ids), MAX_TOKENS) // STRIDE * STRIDE
    buf = np.asarray(ids[:n], dtype="<i4").tobytes()
    out, h, step = [], 0, 4 * STRIDE
    for start in range(0, len(buf), step):
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + buf[start : start + step])
        out.append(h)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Drift:
    """This prompt's render first differs from the earlier one of the same messages
    within `[start, start + STRIDE)`."""

    start: int


class RenderMemory:
    """See the module docstring. Thread-safe."""

    def __init__(self, per_owner: int = 4, max_bytes: int = 8 << 20) -> None:
        if per_owner < 1 or max_bytes < 1:
            raise ValueError(f"per_owner and max_bytes must be >= 1, got {per_owner}, {max_bytes}")
        self.per_owner = per_owner
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._owners: OrderedDict[str, deque[_Render]] = OrderedDict()
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def remember(
        self, owner: str | None, messages: Sequence[dict[str, Any]], tools: Any, ids: Sequence[int]
    ) -> None:
        """A generating request of `owner` (its cache salt) sent `messages` and `tools`,
        which rendered to `ids`."""
        render = _Render(message_digests(messages, tools), prefix_digests(ids))
        key = owner or ""
        with self._lock:
            renders = self._owners.pop(key, None) or deque()
            self._owners[key] = renders
            if len(renders) == self.per_owner:
                self._bytes -= renders.popleft().nbytes
            renders.append(render)
            self._bytes += render.nbytes
            while self._bytes > self.max_bytes and self._owners:
                _, oldest = next(iter(self._owners.items()))
                self._bytes -= oldest.popleft().nbytes
                if not oldest:
                    self._owners.popitem(last=False)

    def drift(
        self,
        owner: str | None,
        messages: Sequence[dict[str, Any]],
        tools: Any,
        ids: Sequence[int],
        message_index: int,
        end: int,
        index: int,
    ) -> Drift | None:
        """Whether `owner` sent `messages[:message_index + 1]` (and `tools`) before and
        that render disagreed with `ids` (whose message `message_index` ends at token
        `end`) at or before the stride holding token `index`."""
        k = message_index + 1
        if not 0 < k <= len(messages):
            return None
        ours = message_digests(messages[:k], tools)
        with self._lock:
            earlier = list(self._owners.get(owner or "", ()))
        if not earlier:
            return None
        mine = prefix_digests(ids[:end])
        for render in reversed(earlier):
            if len(render.messages) <= k or render.messages[k] != ours[k]:
                continue
            n = min(len(mine), len(render.prefixes))
            first = next((s for s in range(n) if mine[s] != render.prefixes[s]), None)
            if first is not None and first * STRIDE <= index:
                return Drift(first * STRIDE)
        return None
