"""A deterministic stand-in for `pagedkv.Engine`, for in-process app tests.

Tokens are UTF-8 bytes + 1 (0 is reserved), generation emits letters chosen
from the prompt (greedy) or a seeded RNG (sampling), and prefix caching is
modelled per cache salt in blocks of `block_size` tokens, so the app's
bookkeeping (usage, salts, block release on cancel, overload) is observable
without a model.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pagedkv.cache.pool import PoolStats
from pagedkv.cache.prefix import CacheStats
from pagedkv.engine.request import GenerationResult, StreamEvent
from pagedkv.engine.sampling import SamplingParams
from pagedkv.engine.stats import EngineStats, RequestCounters
from pagedkv.errors import EngineOverloadedError, PagedKVError
from pagedkv.model.generation_defaults import SamplingDefaults
from pagedkv.storage.base import TierStats

EOS = 300


# A template that renders tools in the Hermes format, as far as the server can tell.
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}<tool_call>"


class FakeEngine:
    """`reply`, when given, is the text every request generates (then eos), so the
    app's parsing of a model's reply (tool calls) can be driven exactly."""

    model_name = "fake-model"
    vocab_size = 301
    sampling_defaults = SamplingDefaults()
    healthy = True

    def __init__(
        self,
        *,
        max_context: int = 256,
        max_queue: int = 64,
        token_delay: float = 0.0,
        block_size: int = 4,
        eos_after: int | None = None,
        reply: str | None = None,
        chat_template: str | None = HERMES_TEMPLATE,
    ) -> None:
        self.reply = reply
        self.chat_template = chat_template
        self.max_context = max_context
        self.max_queue = max_queue
        self.token_delay = token_delay
        self.block_size = block_size
        self.eos_after = eos_after
        self.lock = threading.Lock()
        self.active = 0
        self.allocated = 0
        self.closed = False
        self.cleared = 0
        self.cache: dict[str | None, list[tuple[int, ...]]] = {}
        self.hits = 0
        self.calls: list[dict[str, Any]] = []  # what each stream() call got

    # -- tokenizer ----------------------------------------------------------

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        return [b + 1 for b in text.encode()]  # one token a byte: never refused early

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = bytes(t - 1 for t in ids if 0 < t <= 256).decode(errors="replace")
        return text if skip_special_tokens or EOS not in ids else text + "<eos>"

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return ["<eos>" if t == EOS else repr(bytes([t - 1])) for t in ids]

    def encode_continuation(self, text: str) -> list[int]:
        return self.tokenize(text)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]:
        text = "".join(f"<tools>{json.dumps(list(tools))}\n" if tools else "")
        for m in messages:
            text += f"<{m['role']}>{m['content']}"
            for call in m.get("tool_calls", ()):
                text += f"<call>{json.dumps(call['function'])}"
            text += "\n"
        return self.tokenize(text + ("<assistant>" if add_generation_prompt else ""))

    # -- generation ---------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
    ) -> GenerationResult:
        for event in self.stream(prompt, params, cache_salt=cache_salt, owner=owner):
            if event.finished:
                assert event.result is not None
                return event.result
        raise AssertionError("no result")

    # LoRA adapters: names only (the app's routing and refusals; no weights).
    adapters: dict[str, str]

    def adapter_names(self) -> list[str]:
        return sorted(getattr(self, "adapters", {}))

    def describe_adapters(self) -> list[dict[str, Any]]:
        return [{"name": n, "path": p} for n, p in sorted(getattr(self, "adapters", {}).items())]

    def load_adapter(self, name: str, directory: str) -> dict[str, Any]:
        from pagedkv.errors import AdapterError

        if not directory.startswith("/ok"):
            raise AdapterError(f"adapter {name!r}: {directory} is not a directory")
        self.adapters = {**getattr(self, "adapters", {}), name: directory}
        return {"name": name, "path": directory}

    def unload_adapter(self, name: str) -> None:
        from pagedkv.errors import UnknownAdapterError

        adapters = dict(getattr(self, "adapters", {}))
        if adapters.pop(name, None) is None:
            raise UnknownAdapterError(name, sorted(adapters))
        self.adapters = adapters

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        lora: str | None = None,
    ) -> Iterator[StreamEvent]:
        if lora is not None:
            cache_salt = f"{cache_salt}|lora={lora}"  # the fake's cache keys on the salt
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        params = params or SamplingParams()
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise ValueError("prompt too long")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise AssertionError(f"the app let an out-of-vocabulary token through: {ids}")
        with self.lock:
            if self.closed:
                raise PagedKVError("the engine is closed")
            if self.active >= self.max_queue:
                raise EngineOverloadedError(self.active, self.max_queue)
            self.active += 1
            self.calls.append(
                {"ids": ids, "params": params, "cache_salt": cache_salt, "owner": owner}
            )
        return self._run(ids, params, cache_salt)

    def _run(
        self, ids: list[int], params: SamplingParams, salt: str | None
    ) -> Iterator[StreamEvent]:
        start = time.perf_counter()
        bs = self.block_size
        blocks = -(-len(ids) // bs)
        cached = self._match(ids, salt)
        with self.lock:
            self.allocated += blocks
        rng = random.Random(params.seed) if params.temperature > 0 else None
        out: list[int] = []
        text = ""
        reason = "cancelled"
        ttft = 0.0
        try:
            max_tokens = min(params.max_tokens, self.max_context - len(ids))
            while True:
                if self.token_delay:
                    time.sleep(self.token_delay)
                i = len(out)
                if self.eos_after is not None and i == self.eos_after:
                    reason = "stop"
                    break
                if self.reply is not None and i == len(self.reply):
                    reason = "stop"
                    break
                if self.reply is not None:
                    piece = self.reply[i]
                else:
                    piece = chr(ord("a") + (rng.randrange(26) if rng else (sum(ids) + i) % 26))
                token = ord(piece) + 1
                out.append(token)
                if i == 0:
                    ttft = time.perf_counter() - start
                text += piece
                hit = next((s for s in params.stop if s in text), None)
                if hit is not None:
                    text = text[: text.index(hit)]
                    reason = "stop"
                    yield StreamEvent([token], "", logprobs=[-0.5] if params.logprobs else None)
                    break
                lp = [-0.25 * (i % 4)] if params.logprobs else None
                yield StreamEvent([token], piece, logprobs=lp)
                if len(out) >= max_tokens:
                    reason = "length"
                    break
            result = GenerationResult(
                text=text,
                token_ids=out,
                prompt_tokens=len(ids),
                cached_tokens=cached,
                ttft_s=ttft,
                finish_reason=reason,
                total_s=time.perf_counter() - start,
                logprobs=None,
            )
            yield StreamEvent([], "", finished=True, result=result)
        finally:
            with self.lock:
                self.allocated -= blocks
                self.active -= 1
                if reason != "cancelled":
                    self.cache.setdefault(salt, []).append(tuple(ids))

    def _match(self, ids: list[int], salt: str | None) -> int:
        best = 0
        with self.lock:
            for seen in self.cache.get(salt, []):
                n = 0
                while n < min(len(seen), len(ids) - 1) and seen[n] == ids[n]:
                    n += 1
                best = max(best, n - n % self.block_size)
            if best:
                self.hits += 1
        return best

    # -- cache --------------------------------------------------------------

    def num_active_requests(self) -> int:
        return self.active

    def cache_stats(self) -> EngineStats:
        with self.lock:
            pool = PoolStats(
                num_blocks=64,
                max_blocks=64,
                allocated=self.allocated,
                free=64 - self.allocated,
                cached=0,
                shared=0,
                query_tokens=0,
                hit_tokens=0,
                hit_rate=0.5,
                evictions=0,
                cow_copies=0,
            )
            tiers = {
                "ram": TierStats("ram", hits=self.hits, misses=1, bytes_used=1024,
                                 capacity_bytes=1 << 20),
                "ssd": TierStats("ssd", writes_dropped=3, capacity_bytes=1 << 30,
                                 location="/tmp/fake-ssd"),
            }  # fmt: skip
            return EngineStats(
                model=self.model_name,
                prefix_caching=True,
                caching_off_reason=None,
                requests=RequestCounters(requests=self.active),
                cache=CacheStats("fake-namespace", self.block_size, 4, pool, tiers),
            )

    def list_leases(
        self, owner: str | None = None, *, all_owners: bool = True
    ) -> list[dict[str, Any]]:
        return []  # this double never leases

    def drop_lease(self, lease_id: str) -> bool:
        return False

    def clear_cache(self) -> None:
        with self.lock:
            self.cache.clear()
            self.cleared += 1

    def close(self, timeout: float = 20.0) -> None:
        with self.lock:
            self.closed = True
