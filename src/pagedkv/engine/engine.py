"""The engine: one model worker serving queued requests with prefix reuse."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from pagedkv.cache.builder import build_prefix_cache
from pagedkv.cache.hashing import ExtraKeys
from pagedkv.cache.prefix import PrefixCache, RequestCache
from pagedkv.cache.ram import KVLayout
from pagedkv.config import CacheConfig
from pagedkv.engine.detokenize import Detokenizer
from pagedkv.engine.request import GenerationResult, Request, RequestStream, StreamEvent
from pagedkv.engine.sampling import Sampler, SamplingParams
from pagedkv.engine.stats import EngineStats, RequestCounters
from pagedkv.errors import EngineClosedError, EngineOverloadedError, PagedKVError
from pagedkv.model import ModelAdapter, load_model

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512
_STOP = object()


class Engine:
    """Serves generate/stream/chat calls from any number of threads.

    One worker thread owns the model, the block pool and the RAM tier; callers
    hand it requests through a bounded queue and read events back. Requests in
    flight advance in turn, one prefill chunk or one decoded token at a time,
    so a long generation does not stall a short one. A request's blocks are
    released in a `finally`, so an error or a cancelled stream never leaks
    references.
    """

    def __init__(
        self, adapter: ModelAdapter, config: CacheConfig | None = None, max_queue: int = 64
    ) -> None:
        self.adapter = adapter
        self.config = config or CacheConfig()
        self.max_queue = max_queue
        self.caching_off_reason: str | None = None
        self.prefix: PrefixCache | None = self._build_prefix_cache()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._closed = False
        self._counters = RequestCounters()
        self._worker = threading.Thread(target=self._loop, name="pagedkv-worker", daemon=True)
        self._worker.start()
        # On the worker thread, like every forward: the first one in a thread is slow,
        # and a second thread running OpenMP forwards (this one) would slow every
        # later forward of the worker by ~30% for the life of the process.
        self._call(adapter.warmup)

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m",
        config: CacheConfig | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_queue: int = 64,
    ) -> Engine:
        return cls(load_model(model, device=device, dtype=dtype), config, max_queue)

    def _build_prefix_cache(self) -> PrefixCache | None:
        adapter, config = self.adapter, self.config
        if not config.enable_prefix_caching:
            self.caching_off_reason = "turned off (enable_prefix_caching=False)"
            log.info("prefix caching is off (enable_prefix_caching=False)")
            return None
        if not adapter.prefix_caching_supported:
            self.caching_off_reason = adapter.unsupported_reason
            log.warning(
                "prefix caching is off for %s: %s", adapter.name, adapter.unsupported_reason
            )
            return None
        layout = KVLayout(
            adapter.num_layers,
            adapter.num_kv_heads,
            adapter.head_dim,
            config.block_size,
            adapter.dtype,
        )
        namespace = adapter.fingerprint(config.block_size)
        prefix = build_prefix_cache(config, layout, namespace, adapter.device)
        if prefix is None:
            self.caching_off_reason = "the RAM cache budget holds less than one block"
        return prefix

    # -- public API ---------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.adapter.name

    @property
    def max_context(self) -> int:
        return self.adapter.max_context

    @property
    def vocab_size(self) -> int:
        return self.adapter.vocab_size

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.adapter.decode(token_ids)

    def tokenize(self, text: str) -> list[int]:
        return self.adapter.encode(text)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.adapter.apply_chat_template(list(messages))

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> GenerationResult:
        for event in self.stream(prompt, params, cache_salt=cache_salt):
            if event.finished:
                assert event.result is not None
                return event.result
        raise PagedKVError("the request ended without a result")  # pragma: no cover

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Events as tokens are generated. `cancel()` or `close()` ends the request."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = _check_ids(prompt, self.vocab_size)
        return RequestStream(self._submit(ids, params or SamplingParams(), cache_salt))

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> GenerationResult:
        return self.generate(self.apply_chat_template(messages), params, cache_salt=cache_salt)

    def chat_stream(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestStream:
        return self.stream(self.apply_chat_template(messages), params, cache_salt=cache_salt)

    def num_active_requests(self) -> int:
        with self._lock:
            return self._pending

    def cache_stats(self) -> EngineStats:
        with self._lock:
            counters = dataclasses.replace(self._counters)
        return EngineStats(
            model=self.model_name,
            prefix_caching=self.prefix is not None,
            caching_off_reason=self.caching_off_reason,
            requests=counters,
            cache=self.prefix.stats() if self.prefix is not None else None,
        )

    def clear_cache(self) -> None:
        """Forget this model's unreferenced cached blocks in every tier (other models'
        blocks in a shared SSD directory or Redis stay)."""
        if self.prefix is not None:
            self._call(self.prefix.clear)

    def close(self, timeout: float = 20.0) -> None:
        """Cancel queued work, finish the worker and flush cache writes within `timeout`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        self._queue.put(_STOP)
        self._worker.join(max(0.0, deadline - time.monotonic() - 1.0))
        if self.prefix is not None:
            self.prefix.close(max(0.5, deadline - time.monotonic()))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- caller side --------------------------------------------------------

    def _submit(self, ids: list[int], params: SamplingParams, salt: str | None) -> Request:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is "
                f"{self.max_context}: shorten it"
            )
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            if self._pending >= self.max_queue:
                raise EngineOverloadedError(self._pending, self.max_queue)
            self._pending += 1
        req = Request(ids, params, ExtraKeys(cache_salt=salt) if salt else None)
        self._queue.put(req)
        return req

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread and wait for it."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        done: queue.Queue[Any] = queue.Queue()
        self._queue.put((fn, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    # -- worker side --------------------------------------------------------

    def _loop(self) -> None:
        active: list[tuple[Request, Generator[None, None, None]]] = []
        stopping = False
        while not (stopping and not active):
            try:
                item = self._queue.get(block=not active and not stopping, timeout=None)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    stopping = True
                elif isinstance(item, tuple):
                    fn, done = item
                    try:
                        done.put(fn())
                    except BaseException as exc:  # handed back to the caller
                        done.put(exc)
                elif stopping:
                    item.events.put(EngineClosedError("the engine is shutting down"))
                    self._finish(item, None)
                else:
                    active.append((item, self._run(item)))
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if stopping:
                for req, _ in active:
                    req.cancelled.set()
            for entry in list(active):
                req, gen = entry
                try:
                    if req.cancelled.is_set():
                        if inspect.getgeneratorstate(gen) == inspect.GEN_CREATED:
                            self._abandon(req)  # closing it would not run its `finally`
                        gen.close()
                        raise StopIteration
                    next(gen)
                except StopIteration:
                    active.remove(entry)

    def _abandon(self, req: Request) -> None:
        """End a request cancelled before it started: nothing to release."""
        result = GenerationResult("", [], len(req.prompt), 0, 0.0, "cancelled")
        req.events.put(StreamEvent([], "", finished=True, result=result))
        self._finish(req, result)

    def _finish(self, req: Request, result: GenerationResult | None, error: bool = False) -> None:
        with self._lock:
            self._pending -= 1
            c = self._counters
            if error:
                c.errors += 1
            if result is not None:
                c.requests += 1
                c.prompt_tokens += result.prompt_tokens
                c.cached_tokens += result.cached_tokens
                c.generated_tokens += len(result.token_ids)
                c.cancelled += result.finish_reason == "cancelled"

    def _run(self, req: Request) -> Generator[None, None, None]:
        """One request, advanced one step per `next`: lookup, prefill chunks, tokens."""
        adapter, prefix, params = self.adapter, self.prefix, req.params
        prompt = req.prompt
        max_tokens = min(params.max_tokens, self.max_context - len(prompt))
        handle: RequestCache | None = None
        generated: list[int] = []
        logprobs: list[float] = []
        ttft = 0.0
        reason = "cancelled"
        cached = 0
        decoder: Detokenizer | None = None
        error: Exception | None = None
        kv: Any = None
        # Room for the prompt and the first answer tokens; a longer answer grows it.
        capacity = len(prompt) + min(max_tokens, 256)
        try:
            if prefix is None:
                kv = adapter.new_cache(capacity)
            else:
                kv, buffers = adapter.cache_with_buffers(capacity)
                handle = prefix.begin(prompt, req.extra)
                cached = handle.restore_into(buffers, len(prompt) - 1)
                adapter.set_cache_length(kv, cached)
            logits = None
            for start in range(cached, len(prompt), PREFILL_CHUNK):
                logits, kv = adapter.forward(prompt[start : start + PREFILL_CHUNK], kv)
                if start + PREFILL_CHUNK < len(prompt):
                    yield
            assert logits is not None
            decoder = Detokenizer(adapter, params, ignore=set(adapter.eos_token_ids))
            sampler = Sampler(params)
            for step in itertools.count():
                token, lp = sampler.sample(logits)
                if step == 0:
                    ttft = time.perf_counter() - req.submitted
                generated.append(token)
                logprobs.append(lp)
                delta, done = decoder.push(token)
                if done is None and len(generated) >= max_tokens:
                    done = "length"
                if done is not None:
                    reason = done
                    delta += decoder.flush()
                req.events.put(
                    StreamEvent([token], delta, logprobs=[lp] if params.logprobs else None)
                )
                if step == 0 and handle is not None:
                    # After the first token, not before: nothing here is needed for it.
                    handle.cache_prompt(self._kv_source(kv))
                if done is not None:
                    break
                yield
                logits, kv = adapter.forward([token], kv)
        except Exception as exc:
            log.exception("request failed")
            error, reason = exc, "error"
        finally:
            if handle is not None:
                try:
                    if reason not in ("cancelled", "error"):
                        handle.cache_finished(prompt + generated[:-1], self._kv_source(kv))
                finally:
                    handle.release()
            result = GenerationResult(
                text=decoder.text if decoder else "",
                token_ids=generated,
                prompt_tokens=len(prompt),
                cached_tokens=cached,
                ttft_s=ttft,
                finish_reason=reason,
                total_s=time.perf_counter() - req.submitted,
                logprobs=logprobs if params.logprobs else None,
                tier_hits=dict(handle.tier_hits) if handle else {},
            )
            if error is not None:
                req.events.put(error)
            else:
                req.events.put(StreamEvent([], "", finished=True, result=result))
            self._finish(req, None if error else result, error=error is not None)

    def _kv_source(self, kv: Any) -> Callable[[int, int], torch.Tensor]:
        layers = self.adapter.cache_layers(kv)

        def kv_of(start: int, end: int) -> torch.Tensor:
            return torch.stack(
                [torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers]
            )

        return kv_of


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    out = list(ids)
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"token ids must be ints, got {type(t).__name__}")
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"token id {t} is outside the model's vocabulary (0..{vocab_size - 1})"
            )
    return out
