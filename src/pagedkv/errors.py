"""Typed errors. Messages say what was asked, what was there, and what to do."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class OutOfBlocksError(PagedKVError):
    """The block pool cannot hand out the blocks asked for."""

    def __init__(self, asked: int, available: int, max_blocks: int) -> None:
        self.asked = asked
        self.available = available
        self.max_blocks = max_blocks
        super().__init__(
            f"asked for {asked} KV blocks but only {available} can be freed or grown "
            f"(pool limit max_blocks={max_blocks}, the rest are referenced by running "
            "requests); raise the RAM cache budget or lower concurrency"
        )


class CacheCorruptionError(PagedKVError):
    """A stored block failed verification (checksum, token ids, shape)."""


class ModelNotSupportedError(PagedKVError):
    """The model cannot be loaded or cannot use prefix caching."""


class EngineOverloadedError(PagedKVError):
    """The request queue is full; the caller should retry later."""

    def __init__(self, queued: int, max_queue: int) -> None:
        self.queued = queued
        self.max_queue = max_queue
        super().__init__(
            f"the engine has {queued} requests queued (limit {max_queue}); retry shortly"
        )


class RequestTooLargeError(PagedKVError, ValueError):
    """A request whose KV could never fit the engine's KV budget, however long it waited."""

    def __init__(
        self, prompt_tokens: int, max_tokens: int, n: int, need_bytes: int, budget_bytes: int
    ) -> None:
        self.need_bytes = need_bytes
        self.budget_bytes = budget_bytes
        samples = f" x {n} samples" if n > 1 else ""
        super().__init__(
            f"the request needs {need_bytes / 2**20:.1f} MiB of KV ({prompt_tokens} prompt "
            f"tokens + {max_tokens} max_tokens{samples}) but the engine's KV budget for "
            f"running requests is {budget_bytes / 2**20:.1f} MiB; lower max_tokens or n, "
            "or raise the budget (--kv-budget)"
        )


class PromptTooLongError(PagedKVError, ValueError):
    """A prompt longer than a limit in tokens, found before tokenizing it: it has more
    characters than that many tokens can cover (`model/token_bound.py`)."""

    def __init__(self, num_chars: int, at_least: int, limit: int) -> None:
        self.at_least = at_least
        self.limit = limit
        super().__init__(
            f"the prompt has {num_chars} characters, at least {at_least} tokens, but the "
            f"model's context is {limit} tokens; shorten the prompt"
        )


class EngineClosedError(PagedKVError):
    """The engine was closed (or is shutting down) and takes no more requests."""


class AdapterError(PagedKVError, ValueError):
    """A LoRA adapter cannot be loaded: a missing file, a config pagedkv does not
    support, a rank above the limit, or weights that do not fit the base model."""


class UnknownAdapterError(PagedKVError, KeyError):
    """A request or call named a LoRA adapter that is not loaded."""

    def __init__(self, name: str, loaded: list[str]) -> None:
        self.name = name
        self.loaded = loaded
        listed = ", ".join(map(repr, loaded)) or "none"
        super().__init__(
            f"no LoRA adapter named {name!r} is loaded (loaded: {listed}); load it with "
            "--lora NAME=DIR or POST /v1/adapters"
        )

    def __str__(self) -> str:  # KeyError's own quotes the message
        return str(self.args[0])


class ImagePromptError(PagedKVError, ValueError):
    """A conversation's images cannot be rendered for the model: it takes no images, or
    the processor's placeholder tokens do not line up with the images sent."""
