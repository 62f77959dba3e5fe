"""A tiny pure-torch backend for the seam (`model.backend`): no transformers, no weights.

Each token's KV is computed from its id, its position and the KV of the token
before it, and a token's logits read every KV row up to it: a restore that
writes the wrong rows (or none) changes the logits, so cached == fresh means
the cache restored what was computed. `batched` False runs the one-chunk path
the worker takes for recurrent models (no state here: `state_layout` None).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedkv.model.batch import SeqChunk
from pagedkv.model.generation_defaults import SamplingDefaults
from pagedkv.model.kinds import LayerKinds
from pagedkv.model.kv_format import KVFormat, kv_format

VOCAB = 48
WIDTH = 8


class FakeSeqKV:
    """`buffer` `[1, 2, 1, capacity, WIDTH]`: the seam's format itself."""

    def __init__(self, capacity: int) -> None:
        self.buffer = torch.zeros((1, 2, 1, capacity, WIDTH))

    @property
    def capacity(self) -> int:
        return int(self.buffer.shape[3])

    def restore_target(self) -> torch.Tensor:
        return self.buffer

    def set_restored(self, num_tokens: int, state: torch.Tensor | None) -> None:
        assert state is None, "the fake keeps no recurrent state"

    def kv_of(self, start: int, end: int) -> torch.Tensor:
        return self.buffer[:, :, :, start:end]

    def grown(self, capacity: int, num_tokens: int) -> FakeSeqKV:
        return self.copy(num_tokens, capacity)

    def copy(self, num_tokens: int, capacity: int) -> FakeSeqKV:
        out = FakeSeqKV(capacity)
        out.buffer[:, :, :, :num_tokens] = self.buffer[:, :, :, :num_tokens]
        return out

    def snapshot(self) -> torch.Tensor:
        raise AssertionError("the fake keeps no recurrent state")


class FakeTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % (VOCAB - 3) for c in text]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [f"<{i}>" for i in ids]


class FakeBackend:
    """The `model.backend.Backend` protocol over `FakeSeqKV`s; counts its forwards."""

    def __init__(self, batched: bool = True, reuses_kv: bool | None = None) -> None:
        gen = torch.Generator().manual_seed(11)
        self.embed = torch.randn((VOCAB, WIDTH), generator=gen)
        self.out = torch.randn((WIDTH, VOCAB), generator=gen)
        self.name = "fake"
        self.backend_name = "fake"
        self.refused_features: dict[str, str] = {}
        self.decode_path = "eager"
        self.tokenizer = FakeTokenizer()
        self.max_token_chars: int | None = None
        self.max_context = 2048
        self.vocab_size = VOCAB
        self.eos_token_ids: tuple[int, ...] = ()
        self.sampling_defaults = SamplingDefaults()
        self.kinds = LayerKinds(("full",), (None,))
        self.num_kv_layers = 1
        self.num_kv_heads = 1
        self.kv_windows: tuple[int | None, ...] = (None,)
        self.kv_format: KVFormat = kv_format("auto", torch.float32, WIDTH)
        self.state_layout = None
        self.prefix_caching_supported = True
        self.unsupported_reason: str | None = None
        self.batched = batched
        self.unbatched_reason = None if batched else "the fake runs one sequence at a time"
        # Spares (`engine.spares`): kept where batched unless a test says otherwise.
        self.reuses_kv = batched if reuses_kv is None else reuses_kv
        self.vision = None
        self.lora_layers = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.forward_calls = 0
        # Set by a test: a chunk starting with this token fails its forward.
        self.fail_on_token: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * WIDTH * 4

    def set_kv_dtype(self, name: str) -> None:
        if name != "auto":
            raise ValueError(f"the fake holds float32 KV only, got kv_dtype {name!r}")

    def identity(self, block_size: int, deterministic: bool = False) -> dict[str, str]:
        return {"backend": "fake", "block_size": str(block_size), "batched": str(self.batched)}

    def fingerprint(self, block_size: int, deterministic: bool = False) -> str:
        text = repr(sorted(self.identity(block_size, deterministic).items()))
        return hashlib.sha256(text.encode()).hexdigest()

    def new_kv(self, capacity: int) -> FakeSeqKV:
        return FakeSeqKV(capacity)

    def forward_step(
        self,
        chunks: list[SeqChunk],
        pad_rows: Callable[[int], int] | None = None,
        group_decode: bool = True,
    ) -> torch.Tensor:
        if not self.batched and len(chunks) != 1:
            raise ValueError(f"an unbatched backend takes one chunk, got {len(chunks)}")
        self.forward_calls += 1
        wanted = []
        for chunk in chunks:
            if self.fail_on_token is not None and chunk.token_ids[0] == self.fail_on_token:
                raise RuntimeError("injected: the fake's forward failed")
            logits = self._compute(chunk.kv.buffer[0], chunk.start, chunk.token_ids)
            if chunk.want_logits:
                wanted.append(logits)
        return torch.stack(wanted) if wanted else torch.empty((0, VOCAB))

    def _compute(self, kv: torch.Tensor, start: int, ids: Sequence[int]) -> torch.Tensor:
        """Write each token's K and V into `kv` `[2, 1, capacity, WIDTH]`; the logits of
        the last, which read every row before it."""
        logits = torch.empty(VOCAB)
        for i, token in enumerate(ids):
            p = start + i
            before = kv[0, 0, p - 1] if p else torch.zeros(WIDTH)
            kv[0, 0, p] = torch.tanh(self.embed[token] + 0.5 * before + 0.01 * p)
            kv[1, 0, p] = self.embed[token] * torch.cos(torch.tensor(0.1 * p))
            scores = torch.softmax(kv[0, 0, : p + 1] @ kv[0, 0, p], dim=0)
            logits = (kv[0, 0, p] + scores @ kv[1, 0, : p + 1]) @ self.out
        return logits

    def warmup(self) -> None:
        kv = self.new_kv(4)
        self.forward_step([SeqChunk(kv, 0, [1, 2], True)])

    def compile_decode(self) -> None:
        raise NotImplementedError("the fake backend has no compiled step")

    def close(self) -> None:
        pass

    def stable_rows(self) -> Callable[[int], int] | None:
        return None  # a row is computed alone: every count rounds alike

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        return self.tokenizer.encode(text)

    def check_length(self, text: str, max_tokens: int | None) -> None:
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        raise ValueError("the fake has no chat template")
