"""What the server needs of an engine: `pagedkv.Engine` has it, and so does a test double."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from pagedkv.cache.leases import LeaseRequest
from pagedkv.engine.explain import CacheExplanation
from pagedkv.engine.reasoning import NextTurn
from pagedkv.engine.request import GenerationResult, StreamEvent
from pagedkv.engine.sampling import SamplingParams
from pagedkv.engine.stats import EngineStats
from pagedkv.model.generation_defaults import SamplingDefaults
from pagedkv.model.vision import ImageSpan


class EngineAPI(Protocol):
    """The engine as the routes, metrics and shutdown see it."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def sampling_defaults(self) -> SamplingDefaults: ...

    @property
    def healthy(self) -> bool: ...

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]: ...

    @property
    def chat_template(self) -> str | None: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]: ...

    def encode_continuation(self, text: str) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]: ...

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
    ) -> Iterator[StreamEvent]: ...

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        cache_salt: str | None = None,
        owner: str | None = None,
        background: bool = False,
        images: Sequence[ImageSpan] = (),
    ) -> GenerationResult: ...

    def store_next_turn(
        self,
        messages: Sequence[dict[str, Any]],
        computed: Sequence[int],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        follow: str = "user",
        cache_salt: str | None = None,
        owner: str | None = None,
    ) -> NextTurn | None: ...

    def adapter_names(self) -> list[str]: ...

    def describe_adapters(self) -> list[dict[str, Any]]: ...

    def load_adapter(self, name: str, directory: str) -> dict[str, Any]: ...

    def unload_adapter(self, name: str) -> None: ...

    def list_leases(
        self, owner: str | None = None, *, all_owners: bool = True
    ) -> list[dict[str, Any]]: ...

    def drop_lease(self, lease_id: str) -> bool: ...

    def num_active_requests(self) -> int: ...

    def cache_stats(self) -> EngineStats: ...

    def clear_cache(self) -> None: ...

    def explain(
        self,
        prompt: str | Sequence[int],
        *,
        cache_salt: str | None = None,
        other_salts: Sequence[str] = (),
        lora: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> CacheExplanation: ...

    def close(self, timeout: float = 20.0) -> None: ...
