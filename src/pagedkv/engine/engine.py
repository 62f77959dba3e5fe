"""The engine: many requests at once on one model, with prefix reuse."""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from pagedkv.cache.builder import build_prefix_cache
from pagedkv.cache.hashing import ExtraKeys
from pagedkv.cache.leases import LeaseRequest
from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.ram import KVLayout
from pagedkv.config import CacheConfig, default_kv_budget_bytes
from pagedkv.engine import reasoning
from pagedkv.engine.adapters import Adapters
from pagedkv.engine.explain import CacheExplanation, caching_off, describe
from pagedkv.engine.grammar import GrammarCompiler
from pagedkv.engine.reasoning import NextTurn, ReasoningPolicy
from pagedkv.engine.request import GenerationResult, Request, RequestStream
from pagedkv.engine.sampling import SamplingParams
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.stats import (
    Accounting,
    EngineStats,
    RequestCounters,
    RuntimeInfo,
    SchedulerStats,
)
from pagedkv.engine.worker import Worker
from pagedkv.errors import (
    EngineClosedError,
    EngineOverloadedError,
    ImagePromptError,
    ModelNotSupportedError,
    PagedKVError,
    RequestTooLargeError,
)
from pagedkv.model.backend import Backend
from pagedkv.model.choose import load_backend
from pagedkv.model.fingerprint import describe_namespace
from pagedkv.model.generation_defaults import SamplingDefaults
from pagedkv.model.lora import DEFAULT_MAX_LORA_RANK, LoraWeights
from pagedkv.model.mrope import mrope_positions
from pagedkv.model.vision import ImagePrompt, ImageSpan, has_images, image_segments

log = logging.getLogger(__name__)

_STOP = object()


class Engine:
    """Serves generate/stream/chat calls from any number of threads.

    One worker thread owns the model, the block pool and the RAM tier; callers
    hand it requests through a queue (at most `max_queue` waiting or running)
    and read events back. The worker runs every running request in one batched
    forward per step (see `engine.worker` and `engine.scheduler`), inside a KV
    memory budget (`CacheConfig.kv_budget_bytes`). Every request's blocks and
    buffers are released however it ends.
    """

    def __init__(
        self,
        adapter: Backend | Callable[[], Backend],
        config: CacheConfig | None = None,
        max_queue: int = 64,
        scheduling: SchedulerConfig | None = None,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    ) -> None:
        """`adapter` is a loaded model (a `model.backend.Backend`), or a function that
        loads one (as
        `from_pretrained` passes): then the model loads on the worker thread.
        LoRA adapters (of rank up to `max_lora_rank`) are loaded with `load_adapter`.

        Everything that computes with torch happens on the worker thread: loading
        (when given a loader), building the cache, the warm-up and every forward.
        Each thread that runs an OpenMP operation keeps a team of OpenMP threads
        for the life of the process, and with two teams on this project's 2 cores
        libgomp stops spin-waiting between parallel regions, which was measured to
        slow the worker's batched forwards (docs/architecture.md, "One thread
        computes")."""
        self.config = config or CacheConfig()
        self.max_queue = max_queue
        self.scheduling = scheduling or SchedulerConfig()
        self.caching_off_reason: str | None = None
        self.max_lora_rank = max_lora_rank
        self.prefix: PrefixCache | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._pending = 0
        self._submitted = 0  # requests ever submitted, and ever taken by the worker
        self._taken = 0
        self._lock = threading.Lock()
        self._closed = False
        self._dead: BaseException | None = None
        self._counters = RequestCounters()
        ready: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, args=(adapter, ready), name="pagedkv-worker", daemon=True
        )
        self._thread.start()
        failure = ready.get()
        if failure is not None:
            self._thread.join()
            raise failure

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m",
        config: CacheConfig | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_queue: int = 64,
        scheduling: SchedulerConfig | None = None,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        backend: str | None = None,
    ) -> Engine:
        """Load `model` on the worker thread: the bundled model's name, a Hugging Face
        directory, a .gguf file or a Hub id in the local Hugging Face cache
        (`pagedkv.model.resolve`), computed by `backend` ("auto", "torch", "mlx";
        None: `config.backend`, `model.choose`)."""
        chosen = backend or (config.backend if config is not None else "auto")

        def load() -> Backend:
            backend: Backend = load_backend(model, chosen, device=device, dtype=dtype)
            return backend

        return cls(load, config, max_queue, scheduling, max_lora_rank)

    def _set_up(self, given: Backend | Callable[[], Backend]) -> None:
        """On the worker thread: load, build the cache, the scheduler and the worker, warm up."""
        adapter = _loaded(given)
        if self.scheduling.deterministic and adapter.deterministic_reason is not None:
            raise ModelNotSupportedError(adapter.deterministic_reason)
        self.adapter = adapter
        self.adapters = Adapters(adapter, self._call, self.max_lora_rank)
        log.info("sampling defaults of %s: %s", adapter.name, self.sampling_defaults.describe())
        # Before any buffer exists, with caching on or off: the same rounding either way.
        adapter.set_kv_dtype(self.config.kv_dtype)
        if self.config.compile_decode:
            if self.scheduling.deterministic:
                raise ModelNotSupportedError(
                    "compile_decode and deterministic do not go together: deterministic "
                    "steps pad their rows to counts that round alike, which the eager step does"
                )
            adapter.compile_decode()  # before the namespace: the step is in its mode
        if adapter.vision is not None:
            adapter.vision.cache.resize(self.config.vision_cache_bytes)
        self.prefix = self._build_prefix_cache()
        self.reasoning = self._reasoning_policy()
        # The ids that open a reasoning block, for explain's `reasoning_stripped`.
        strips = self.reasoning.strips
        self._think_ids = self.encode_continuation(reasoning.THINK_OPEN) if strips else None
        budget = self.config.kv_budget_bytes
        self.kv_budget_bytes = default_kv_budget_bytes() if budget is None else budget
        per_token = adapter.kv_bytes_per_token
        snapshots = self.prefix.snapshots if self.prefix is not None else None
        # Room for the one recurrent-state snapshot a running sequence may hold
        # (`Worker._keep_snapshot`), in tokens of KV: it counts in the same budget.
        snapshot_tokens = -(-snapshots.nbytes // per_token) if snapshots is not None else 0
        scheduler = Scheduler(self.scheduling, self.kv_budget_bytes // per_token, snapshot_tokens)
        scheduler.min_shared_tokens = self.config.block_size
        self._worker = Worker(adapter, self.prefix, scheduler, self._request_done)
        self._grammars = GrammarCompiler(
            adapter.tokenizer, adapter.eos_token_ids, adapter.vocab_size
        )
        # The first forward in a thread is slow: pay it here, not in the first request.
        adapter.warmup()
        # Prompt steps are padded always, every step if deterministic.
        self._worker.rows = adapter.stable_rows()
        if self._worker.rows is not None:
            log.info("padded batches: row counts %s", getattr(self._worker.rows, "stable", "?"))

    def _reasoning_policy(self) -> ReasoningPolicy:
        mode = self.config.reasoning_cache
        has_template = isinstance(getattr(self.adapter.tokenizer, "chat_template", None), str)
        render = self.apply_chat_template if has_template and self.prefix is not None else None
        found = reasoning.policy(
            mode, render, functools.partial(self.decode, skip_special_tokens=False)
        )
        log.info("reasoning-aware storing: %s", found.describe())
        return found

    def _build_prefix_cache(self) -> PrefixCache | None:
        adapter, config = self.adapter, self.config
        if not config.enable_prefix_caching:
            self.caching_off_reason = "turned off (enable_prefix_caching=False)"
            log.info("prefix caching is off (enable_prefix_caching=False)")
            return None
        if not adapter.prefix_caching_supported:
            self.caching_off_reason = adapter.unsupported_reason
            log.warning("prefix caching is off for %s: %s", adapter.name, self.caching_off_reason)
            return None
        state = adapter.state_layout
        layout = KVLayout(
            adapter.num_kv_layers,
            adapter.num_kv_heads,
            adapter.kv_format.row_width,
            config.block_size,
            adapter.kv_format.storage_dtype,
            windows=adapter.kv_windows if any(adapter.kv_windows) else (),
            state_numel=state.numel if state is not None else 0,
        )
        log.info("layers of %s: %s", adapter.name, adapter.kinds.describe())
        namespace = adapter.fingerprint(config.block_size, self.scheduling.deterministic)
        # Who writes the namespace: `pagedkv cache stats` shows it (SSD), and explain's
        # `identity_changed` compares it with the others' (SSD and Redis keep it).
        persistent = config.ssd_cache_dir or config.redis_url
        description = describe_namespace(adapter, config.block_size) if persistent else None
        prefix = build_prefix_cache(config, layout, namespace, adapter.device, description)
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

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's recommended sampling values, for fields a request leaves out."""
        return getattr(self.adapter, "sampling_defaults", None) or SamplingDefaults()

    @property
    def reasoning_active(self) -> bool:
        """Whether finished turns are also stored in the next prompt's form
        (`store_next_turn`, `engine.reasoning`)."""
        return self.reasoning.active

    @property
    def healthy(self) -> bool:
        """False once the worker thread has died (a bug); the engine then serves nothing."""
        return self._dead is None and self._thread.is_alive()

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.adapter.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own string in the tokenizer's vocabulary (byte-level pieces such as
        'Ġword', special tokens by name): what `POST /tokenize` shows as `token_strs`.
        An id the model has but the tokenizer lacks (padded embeddings) is ""."""
        pieces = self.adapter.tokenizer.convert_ids_to_tokens(list(token_ids))
        return ["" if p is None else str(p) for p in pieces]

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; with `max_tokens`, a text with more characters than that
        many tokens can cover raises PromptTooLongError before it is tokenized."""
        return self.adapter.encode(text, max_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]:
        """Token ids of a conversation; `tools` (OpenAI function definitions) are passed
        to the template, which decides how the model sees them. Without the generation
        prompt the ids end with the last message (`POST /tokenize` can ask for that).
        `max_tokens`: as for `tokenize`, on the rendered text."""
        extra: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "max_tokens": max_tokens,
        }
        if tools:
            extra["tools"] = list(tools)
        return self.adapter.apply_chat_template(list(messages), **extra)

    @property
    def takes_images(self) -> bool:
        """Whether the model reads images (`render_chat` renders image parts)."""
        return self.adapter.vision is not None

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
    ) -> ImagePrompt:
        """A conversation whose content may hold image parts (`{"type": "image",
        "image": ImageInput}`): its ids, each image's placeholder tokens expanded, and the
        images' spans to pass to `stream(images=...)`. A text model refuses image parts
        (ImagePromptError, a ValueError); for it this is `apply_chat_template`."""
        if self.adapter.vision is None:
            if has_images(messages):
                raise ImagePromptError(
                    f"model {self.model_name} takes no images; send text content only"
                )
            ids = self.apply_chat_template(
                messages, tools, add_generation_prompt=add_generation_prompt,
                max_tokens=max_tokens,
            )  # fmt: skip
            return ImagePrompt(ids)
        extra: dict[str, Any] = {}
        if tools:
            extra["tools"] = list(tools)
        return self.adapter.vision.render(
            list(messages),
            add_generation_prompt,
            check=lambda text: self.adapter.check_length(text, max_tokens),
            **extra,
        )

    @property
    def chat_template(self) -> str | None:
        """The model's chat template source; None when it has none (or several)."""
        template = getattr(self.adapter.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` continuing a prompt: no BOS or other added tokens."""
        return [int(t) for t in self.adapter.tokenizer.encode(text, add_special_tokens=False)]

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        lora: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> GenerationResult:
        """The finished request (`params.n` must be 1; see `generate_n`)."""
        if params is not None and params.n != 1:
            raise ValueError(f"generate returns one sample, n is {params.n}: use generate_n")
        return self.generate_n(
            prompt, params, cache_salt=cache_salt, owner=owner, lora=lora, images=images
        )[0]

    def generate_n(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        lora: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> list[GenerationResult]:
        """The `params.n` samples of one request, by index."""
        results: dict[int, GenerationResult] = {}
        stream = self.stream(
            prompt, params, cache_salt=cache_salt, owner=owner, lora=lora, images=images
        )
        for event in stream:
            if event.finished:
                assert event.result is not None
                results[event.index] = event.result
        if not results:
            raise PagedKVError("the request ended without a result")  # pragma: no cover
        return [results[i] for i in sorted(results)]

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        lora: str | None = None,
        leases: Sequence[LeaseRequest] = (),
        images: Sequence[ImageSpan] = (),
    ) -> RequestStream:
        """Events as tokens are generated. `cancel()` or `close()` ends the request.
        `owner` names who sent it (the server passes the API key's tenant): when the
        head of the waiting queue cannot start, other owners' requests may start
        before it, in turn (see `Scheduler`); requests of one owner keep their order.
        `lora` names a loaded LoRA adapter to generate with (None: the base model).

        `leases`: prefixes of the prompt to lease once it is cached (`cache.leases`),
        owned by `owner`; ignored when prefix caching is off.

        `images`: the prompt's images, as `render_chat` returned them with its ids."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = _check_ids(prompt, self.vocab_size)
        req = self._submit(
            ids, params or SamplingParams(), cache_salt, owner, lora, leases=tuple(leases),
            images=tuple(images),
        )  # fmt: skip
        return RequestStream(req)

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        background: bool = False,
        images: Sequence[ImageSpan] = (),
    ) -> GenerationResult:
        """Compute and cache `prompt`'s KV without generating (see `prewarm_stream`)."""
        result = None
        for event in self.prewarm_stream(
            prompt, cache_salt=cache_salt, owner=owner, background=background, images=images
        ):
            result = event.result
        if result is None:
            raise PagedKVError("the prewarm ended without a result")  # pragma: no cover
        return result

    def prewarm_stream(
        self,
        prompt: str | Sequence[int],
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        background: bool = False,
        images: Sequence[ImageSpan] = (),
    ) -> RequestStream:
        """A prefill-only request: its prompt waits, is admitted and prefilled like any
        other (queue bound, KV budget, fair admission by `owner`), then its KV is cached
        and it ends with one finished event, no token, finish_reason "stored":
        `cached_tokens` were found before, `stored_tokens` are held after.
        `background`: behind every other request (`Scheduler.add`). `images`: the
        prompt's images as `render_chat` returned them (their keys are in the blocks')."""
        ids = (
            self.tokenize(prompt)
            if isinstance(prompt, str)
            else _check_ids(prompt, self.vocab_size)
        )
        params = SamplingParams(max_tokens=1, temperature=0.0)
        req = self._submit(
            ids, params, cache_salt, owner, prefill_only=True, background=background,
            images=tuple(images),
        )  # fmt: skip
        return RequestStream(req)

    def store_next_turn(
        self,
        messages: Sequence[dict[str, Any]],
        computed: Sequence[int],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        follow: str = "user",
        cache_salt: str | None = None,
        owner: str | None = None,
    ) -> NextTurn | None:
        """After a turn: `messages` is the conversation with the turn's answer last, as
        the client will send it back; `computed` the ids whose KV the turn cached (its
        prompt and generated tokens). When reasoning-aware storing is on
        (`engine.reasoning`) and the next request's form of this conversation is not
        already a prefix of `computed` (the template stripped the reasoning), queue a
        background prefill-only request for it; returns what was found and done, None
        when the policy is off. `follow`: the next message's role, "tool" after a tool
        call (a template keeps the reasoning of the current tool loop), else "user".
        A conversation with images is rendered as `render_chat` renders it, and the
        stored form carries its images' keys. Renders on the calling thread; never
        blocks on the worker."""
        if not self.reasoning.active or self.prefix is None:
            return None
        rendered: list[ImagePrompt] = []

        def render(conversation: list[dict[str, Any]]) -> list[int]:
            rendered.append(self.render_chat(conversation, tools))
            return rendered[-1].token_ids

        ids = reasoning.next_turn_ids(render, messages, follow)
        # The images lie in earlier messages, before the cut: their spans and keys are
        # the next request's own (the same pixels, the same processor, the same places).
        images = tuple(span for span in rendered[0].images if span.end <= len(ids))
        shared = reasoning.common_prefix(ids, computed)
        if shared >= len(ids) or len(ids) >= self.max_context:
            return NextTurn(len(ids), shared, submitted=False)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        try:
            self._submit(
                ids, params, cache_salt, owner, prefill_only=True, background=True,
                images=images,
            )  # fmt: skip
        except PagedKVError as exc:  # a full queue or budget: the next turn recomputes it
            log.info("next-turn storing skipped: %s", exc)
            return NextTurn(len(ids), shared, submitted=False)
        return NextTurn(len(ids), shared, submitted=True)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
    ) -> GenerationResult:
        rendered = self.render_chat(messages)
        return self.generate(
            rendered.token_ids, params, cache_salt=cache_salt, owner=owner,
            images=rendered.images,
        )  # fmt: skip

    def chat_stream(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
    ) -> RequestStream:
        rendered = self.render_chat(messages)
        return self.stream(
            rendered.token_ids, params, cache_salt=cache_salt, owner=owner,
            images=rendered.images,
        )  # fmt: skip

    def load_adapter(self, name: str, directory: str | Path) -> dict[str, Any]:
        """Load the PEFT LoRA adapter in `directory` as `name` (a reload when the name is
        loaded); read and checked on this thread, installed between two steps
        (`engine.adapters`). AdapterError says what is wrong with it."""
        return self.adapters.load(name, directory)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; running requests finish with it."""
        self.adapters.unload(name)

    def adapter_names(self) -> list[str]:
        return self.adapters.names()

    def describe_adapters(self) -> list[dict[str, Any]]:
        return self.adapters.describe()

    def num_active_requests(self) -> int:
        with self._lock:
            return self._pending

    def cache_stats(self) -> EngineStats:
        worker, sched = self._worker, self._worker.scheduler
        with self._lock:
            counters = dataclasses.replace(self._counters)
        scheduling = SchedulerStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_budget_bytes=self.kv_budget_bytes,
            kv_reserved_bytes=sched.reserved_tokens * self.adapter.kv_bytes_per_token,
            preemptions=worker.preemptions,
            steps=worker.steps,
            cache_errors=worker.cache_errors,
            batched=self.adapter.batched,
            deterministic=self.scheduling.deterministic,
        )
        return EngineStats(
            model=self.model_name,
            prefix_caching=self.prefix is not None,
            caching_off_reason=self.caching_off_reason,
            requests=counters,
            cache=self.prefix.stats() if self.prefix is not None else None,
            scheduling=scheduling,
            runtime=RuntimeInfo(
                # The library that computes: transformers on torch, or mlx-lm on MLX, whose
                # seam tensors sit on the CPU while it computes on `compute_device` (Metal).
                backend="transformers" if self.adapter.backend_name == "torch" else "mlx-lm",
                device=str(getattr(self.adapter, "compute_device", self.adapter.device)),
                dtype=str(self.adapter.dtype).removeprefix("torch."),
                kv_dtype=self.config.kv_dtype,
                refused=dict(self.adapter.refused_features),
                decode=self.adapter.decode_path,
            ),
            request_misses=worker.miss_reasons.copy(),
            vision=self.adapter.vision.cache.stats() if self.adapter.vision else None,
        )

    def accounting(self) -> Accounting:
        """The engine's books, read on the worker thread between two steps; a soak
        asserts `balanced` (no leaked slot or reservation) once traffic stops."""

        def read() -> Accounting:
            sched = self._worker.scheduler
            scheduled = {id(s.request) for s in [*sched.running, *sched.waiting]}
            with self._lock:
                pending, queued = self._pending, self._submitted - self._taken
            return Accounting(
                pending_requests=pending,
                queued_requests=queued,
                scheduled_requests=len(scheduled),
                running=len(sched.running),
                waiting=len(sched.waiting),
                kv_reserved_bytes=sched.reserved_tokens * self.adapter.kv_bytes_per_token,
            )

        result: Accounting = self._call(read)
        return result

    def explain(
        self,
        prompt: str | Sequence[int],
        *,
        cache_salt: str | None = None,
        other_salts: Sequence[str] = (),
        lora: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> CacheExplanation:
        """What a request for `prompt` with `cache_salt` would reuse if sent now, and the
        cause of its first recomputed token. Hashes and looks up; never runs the model,
        takes no block and changes no counter. Runs on the calling thread, not the
        worker's (see `pagedkv.cache.explain` for why that is safe). `other_salts`:
        other tenants' salts whose holding this prefix the caller may learn (the
        `other_tenant` reason; the server passes them to admin keys only). `images`: the
        prompt's images as `render_chat` returned them: their keys are looked up as the
        request's own (`image_changed` names one that differs from what is cached)."""
        ids = (
            self.tokenize(prompt)
            if isinstance(prompt, str)
            else _check_ids(prompt, self.vocab_size)
        )
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        images = tuple(images)
        if images:
            self._check_images(ids, images)
        if self.prefix is None:
            return caching_off(len(ids), self.caching_off_reason)
        held = None if lora is None else self.adapters.acquire(lora)
        if held is not None:
            self.adapters.release(held)
        extra = _extra_keys(cache_salt, held, images)
        others = [
            _extra_keys(s, held, images) for s in dict.fromkeys(other_salts) if s != cache_salt
        ]
        exp = self.prefix.explain(
            ids, extra, other_tenants=[e for e in others if e is not None], think=self._think_ids
        )
        return describe(exp, ids, self.decode)

    def list_leases(
        self, owner: str | None = None, *, all_owners: bool = True
    ) -> list[dict[str, Any]]:
        """The live leases (`cache.leases`), least recently renewed first, as JSON; of
        `owner` only unless `all_owners`. Any thread."""
        if self.prefix is None:
            return []
        table = self.prefix.leases
        now = table.clock()
        return [lease.to_json(now) for lease in table.list(owner, all_tenants=all_owners)]

    def drop_lease(self, lease_id: str) -> bool:
        """Lapse the lease `lease_id` now; False when there is none. Any thread."""
        return self.prefix is not None and self.prefix.leases.drop(lease_id)

    def clear_cache(self) -> None:
        """Forget this model's unreferenced cached blocks in every tier (other models'
        blocks in a shared SSD directory or Redis stay).

        The lower tiers are cleared on the calling thread, so running requests keep
        decoding meanwhile (a big SSD directory or Redis takes seconds); then the RAM
        tier on the worker, which owns it. In that order, a block a request brought
        up from a lower tier while the clear ran is dropped from RAM too; blocks
        computed while it ran may survive it."""
        if self.prefix is not None:
            self.prefix.clear_lower()
            self._call(self.prefix.clear_ram)
        if self.adapter.vision is not None:
            self._call(self.adapter.vision.cache.clear)

    def close(self, timeout: float = 20.0) -> None:
        """Cancel queued work, finish the worker and flush cache writes within `timeout`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        self._queue.put(_STOP)
        self._thread.join(max(0.0, deadline - time.monotonic() - 1.0))
        if self.prefix is not None:
            self.prefix.close(max(0.5, deadline - time.monotonic()))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- caller side --------------------------------------------------------

    def _submit(
        self,
        ids: list[int],
        params: SamplingParams,
        salt: str | None,
        owner: str | None,
        lora_name: str | None = None,
        *,
        prefill_only: bool = False,
        background: bool = False,
        leases: tuple[LeaseRequest, ...] = (),
        images: tuple[ImageSpan, ...] = (),
    ) -> Request:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if images:
            self._check_images(ids, images)
        if len(ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is "
                f"{self.max_context}: shorten it"
            )
        answer = min(params.max_tokens, self.max_context - len(ids))
        snapshot = self._worker.scheduler.snapshot_tokens
        need = (len(ids) + answer + snapshot) * params.n * self.adapter.kv_bytes_per_token
        if need > self.kv_budget_bytes:
            raise RequestTooLargeError(len(ids), answer, params.n, need, self.kv_budget_bytes)
        fmt = params.response_format
        grammar = None if fmt is None else self._grammars.compile(fmt)  # GrammarError: a 400
        lora = None if lora_name is None else self.adapters.acquire(lora_name)
        try:
            with self._lock:
                if self._closed or self._dead is not None:
                    raise EngineClosedError(self._closed_reason())
                if self._pending >= self.max_queue:
                    raise EngineOverloadedError(self._pending, self.max_queue)
                self._pending += 1
                self._submitted += 1
        except BaseException:
            if lora is not None:
                self.adapters.release(lora)
            raise
        extra = _extra_keys(salt, lora, images)
        req = Request(ids, params, extra, owner=owner, grammar=grammar, lora=lora,
                      prefill_only=prefill_only, background=background, leases=leases,
                      images=images, positions=mrope_positions(images))  # fmt: skip
        self._queue.put(req)
        return req

    def _check_images(self, ids: list[int], images: tuple[ImageSpan, ...]) -> None:
        """Images need a model that reads them through the ragged batch, and spans that
        lie on the prompt's placeholder tokens, in order, apart."""
        vision = self.adapter.vision
        if vision is None:
            raise ImagePromptError(f"model {self.model_name} takes no images")
        if not self.adapter.batched:
            raise ImagePromptError(
                f"images need the ragged batch, and {self.model_name} runs one sequence "
                f"per forward ({self.adapter.unbatched_reason})"
            )
        end = 0
        for span in images:
            if not end <= span.start < span.end <= len(ids) or set(ids[span.start : span.end]) != {
                vision.image_token_id
            }:
                raise ImagePromptError(
                    f"an image span [{span.start}, {span.end}) does not lie on the "
                    "prompt's image placeholder tokens after the one before it"
                )
            if span.bidirectional != vision.bidirectional:
                said, want = (
                    "both ways" if b else "causally"
                    for b in (span.bidirectional, vision.bidirectional)
                )
                raise ImagePromptError(
                    f"an image span [{span.start}, {span.end}) says its tokens attend "
                    f"{said}, and {self.model_name}'s attend {want}: render the prompt "
                    "with this engine's render_chat"
                )
            grid = span.rope_grid
            if (grid is not None) != vision.mrope or (
                grid is not None and grid[0] * grid[1] * grid[2] != span.num_tokens
            ):
                raise ImagePromptError(
                    f"the image span [{span.start}, {span.end}) has position grid {grid} "
                    f"where {self.model_name} "
                    + ("places image tokens by their grid" if vision.mrope else "takes none")
                    + ": pass the spans render_chat returned"
                )
            end = span.end

    def _closed_reason(self) -> str:
        if self._dead is not None:
            return f"the engine's worker died ({type(self._dead).__name__}: {self._dead})"
        return "the engine is closed"

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the worker thread and wait for it."""
        if self._closed or self._dead is not None:
            raise EngineClosedError(self._closed_reason())
        done: queue.Queue[Any] = queue.Queue()
        self._queue.put((fn, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    # -- worker side --------------------------------------------------------

    def _loop(
        self,
        adapter: Backend | Callable[[], Backend],
        ready: queue.Queue[BaseException | None],
    ) -> None:
        try:
            self._set_up(adapter)
        except BaseException as exc:  # handed to the constructor, which raises it
            ready.put(exc)  # first: a close that fails too must not leave it waiting
            if self.prefix is not None:
                self.prefix.close(5.0)  # before the constructor raises: it joins this thread
            return
        ready.put(None)
        try:
            self._serve()
        except BaseException as exc:  # a bug: end every caller rather than hang them
            log.critical("the engine's worker died; failing every request", exc_info=True)
            self._dead = exc
            dead = EngineClosedError(self._closed_reason())
            self._worker.fail_all(dead)
            self._drain(dead)
        finally:  # on this thread, which computed with them (`Backend.close`)
            self._worker.spares.drop_all()
            self.adapter.close()

    def _serve(self) -> None:
        worker = self._worker
        stopping = False
        while True:
            stopping = self._take_queued(block=not worker.busy and not stopping) or stopping
            if stopping:
                worker.fail_all(EngineClosedError("the engine is shutting down"))
                return
            worker.step()
            self.adapters.collect()

    def _take_queued(self, block: bool) -> bool:
        """Move queued requests to the scheduler and run queued calls; True on stop."""
        try:
            item = self._queue.get(block=block)
        except queue.Empty:
            return False
        while True:
            if item is _STOP:
                return True
            if isinstance(item, tuple):
                fn, done = item
                try:
                    done.put(fn())
                except BaseException as exc:  # handed back to the caller
                    done.put(exc)
            else:
                with self._lock:
                    self._taken += 1
                try:
                    self._worker.add(item)
                except Exception as exc:  # its sequence cannot be built: it alone fails
                    log.exception("a request could not start")
                    item.failed = True
                    item.events.put(exc)
                    self._request_done(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False

    def _drain(self, exc: BaseException) -> None:
        """After the worker died: fail whatever is still queued, now and later."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if item is _STOP:
                return
            if isinstance(item, tuple):
                item[1].put(exc)
            else:
                item.events.put(exc)
                self._request_done(item)

    def _request_done(self, req: Request) -> None:
        if req.lora is not None:
            self.adapters.release(req.lora)
        with self._lock:
            self._pending -= 1
            c = self._counters
            if req.failed:
                c.errors += 1
                return
            c.requests += 1
            c.prompt_tokens += len(req.prompt)
            c.cached_tokens += max((r.cached_tokens for r in req.results), default=0)
            c.generated_tokens += sum(len(r.token_ids) for r in req.results)
            c.cancelled += any(r.finish_reason == "cancelled" for r in req.results)


def _extra_keys(
    salt: str | None, lora: LoraWeights | None, images: Sequence[ImageSpan] = ()
) -> ExtraKeys | None:
    """The salt, the adapter's digest (its weights and config, never its name) and the
    images' segments (`model.vision.image_segments`)."""
    if not salt and lora is None and not images:
        return None
    return ExtraKeys(
        cache_salt=salt or None,
        adapter=None if lora is None else lora.digest,
        segments=image_segments(images),
    )


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


def _loaded(given: Backend | Callable[[], Backend]) -> Backend:
    """The backend `given`, loading it first where it is a loader: a loaded backend has
    the seam's step (`Backend.forward_step`), a loader is a function of nothing.
    Rejected: `isinstance` on the torch class, which refused every other backend."""
    if hasattr(given, "forward_step"):
        return cast("Backend", given)
    return cast("Callable[[], Backend]", given)()
