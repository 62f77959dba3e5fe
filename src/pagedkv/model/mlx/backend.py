"""The MLX backend: a model loaded through mlx-lm behind the `model.backend` seam.

mlx-lm builds the model from a Hugging Face safetensors directory, mlx-community's
quantized ones (4-bit, 8-bit) included; the tokenizer is transformers' own, through
the same text methods as the torch backend (`model.text`), so a prompt is the same
token ids on either. A sequence's KV lives in mlx-lm's cache objects (`seq_kv`),
each attention layer's (sliding ones too) a growing cache in the KV format, each
recurrent layer's mlx-lm's own `ArraysCache` (`layers`).

A step (`forward_step`): each prompt chunk runs alone through the model with its
sequence's cache; the decode rows of every sequence run in one model call
(`seq_kv.DecodeLayer`). Measured on mlx-cpu 0.32.4: a prompt's rows come out bit
for bit alike whatever chunks it was cut into, and a decode row alike in a batch
and alone, sliding windows included (tests/model/test_mlx_backend.py,
tests/model/test_mlx_kinds.py); Metal's kernels are other kernels, and the
namespace's device field keeps their KV apart. A model with recurrent layers runs
one sequence per call (`batched` False), so the worker can snapshot between calls.

What this backend does not do yet, each refused by name: prefix caching for models
whose layers `layers.probe` finds it cannot keep exactly (a cache class it does not
know, a window the model's code does not mask, a recurrent layer that computes a
prompt otherwise in chunks, as mlx-lm's Mamba-2 in Falcon-H1: the model still runs,
one sequence per call, caching off with `unsupported_reason`); kv_dtype int8; the
deterministic option; LoRA adapters; images.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import torch
from mlx_lm.models.cache import make_prompt_cache

from pagedkv.cache.identity import NAMESPACE_FIELDS, namespace_digest
from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.batch import SeqChunk
from pagedkv.model.bundled import BUNDLED_MODEL_NAME
from pagedkv.model.generation_defaults import (
    BUNDLED_DEFAULTS,
    SamplingDefaults,
    read_sampling_defaults,
)
from pagedkv.model.kinds import LayerKinds
from pagedkv.model.kv_format import KVFormat, kv_format
from pagedkv.model.mlx import identity as ident
from pagedkv.model.mlx.convert import mx_dtype, to_torch, torch_dtype
from pagedkv.model.mlx.last_row import install as install_last_row
from pagedkv.model.mlx.last_row import last_row_only
from pagedkv.model.mlx.layers import StoredKVCache, probe, substituted
from pagedkv.model.mlx.seq_kv import DecodeLayer, MlxSeqKV
from pagedkv.model.state import StateLayout
from pagedkv.model.text import TextMethods
from pagedkv.model.token_bound import max_chars_per_token

logger = logging.getLogger(__name__)

# Bumped with the torch backend's (`model.hf.KV_LAYOUT_VERSION`): what a stored row means.
KV_LAYOUT_VERSION = 2

DETERMINISTIC_REASON = (
    "the deterministic option is not available on the MLX backend: its padded row counts "
    "were measured for torch's CPU kernels only; run without --deterministic"
)
LORA_REASON = "LoRA adapters are not available on the MLX backend; use --backend torch"
IMAGES_REASON = "images are not available on the MLX backend; use --backend torch"
COMPILE_REASON = (
    "the compiled decode step is torch's (AOTInductor); the MLX backend runs mlx-lm's "
    "model as it is; leave compile_decode off"
)
KV_INT8_REASON = (
    "8-bit KV is not available on the MLX backend (8-bit KV with per-row scales is torch's "
    "ragged attention only); use kv_dtype auto, bfloat16 or float16"
)


class MlxBackend(TextMethods):
    """A loaded mlx-lm model, its tokenizer and its KV plumbing (`model.backend.Backend`).

    Invariants: every array a step computes is evaluated before `forward_step`
    returns (MLX is lazy; an unevaluated cache would grow one graph across a whole
    generation). Not thread-safe: one worker thread owns it (the engine loads and
    computes on its worker thread, as for torch).
    """

    backend_name = "mlx"
    deterministic_reason: str | None = DETERMINISTIC_REASON
    refused_features: dict[str, str] = {  # noqa: RUF012 (read only)
        "deterministic": DETERMINISTIC_REASON,
        "kv_dtype int8": KV_INT8_REASON,
        "lora": LORA_REASON,
        "images": IMAGES_REASON,
        "compile_decode": COMPILE_REASON,
    }
    vision = None
    lora_layers = None
    decode_path = "eager (mlx-lm's model)"

    def __init__(
        self, model: Any, tokenizer: Any, config: dict[str, Any], *, name: str,
        model_dir: Path | None = None, generation_config: Any = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.model_dir = model_dir
        # Where the seam's tensors live: MLX's KV converts to CPU tensors (`convert`).
        self.device = torch.device("cpu")
        self.max_token_chars = max_chars_per_token(tokenizer)
        # Prompt chunks compute their last row's logits only, where that is exact.
        self._last_row = install_last_row(model)
        # A few tokens through fresh caches: each layer's kind, the KV's heads, width and
        # dtype, the recurrent state's layout and the vocab (`layers.probe`).
        found = probe(model)
        self.kinds: LayerKinds = found.kinds
        self._stored = found.stored
        self.kv_layers: tuple[int, ...] = self.kinds.kv_layers
        self.num_layers = len(self.kinds.kinds)
        self.num_kv_layers = len(self.kv_layers)
        self.kv_windows: tuple[int | None, ...] = self.kinds.kv_windows
        self.unsupported_reason: str | None = self.kinds.unsupported
        self.prefix_caching_supported = self.unsupported_reason is None
        self.unbatched_reason: str | None = self.kinds.unbatched
        self.batched = self.unbatched_reason is None
        # MLX arrays are no preallocated buffer: a kept one would be refilled through a
        # torch copy (`restore_target`, `set_restored`) where `grown` and `copy` stay in MLX.
        self.reuses_kv = False
        self.state_layout: StateLayout | None = found.state_layout
        self.vocab_size = found.vocab_size
        self.num_kv_heads, self.head_dim, compute = 0, 0, mx.float32
        if found.keys is not None:
            _, self.num_kv_heads, _, self.head_dim = (int(d) for d in found.keys.shape)
            compute = found.keys.dtype
        self.compute_dtype = compute
        self.dtype: torch.dtype = torch_dtype(compute)
        self.kv_format: KVFormat = kv_format("auto", self.dtype, max(1, self.head_dim))
        self.max_context = int(config.get("max_position_embeddings") or 2048)
        self.eos_token_ids = _eos_token_ids(generation_config, tokenizer)
        self.sampling_defaults: SamplingDefaults = read_sampling_defaults(generation_config)
        if name == BUNDLED_MODEL_NAME and self.sampling_defaults.source == "none":
            self.sampling_defaults = BUNDLED_DEFAULTS  # as the torch backend does
        self.linear_kernel = ident.linear_kernel(config)
        self._static_identity: dict[str, str] | None = None
        self._native = make_prompt_cache(model)  # the classes `new_kv` substitutes

    # ---- identity -------------------------------------------------------

    @property
    def compute_device(self) -> str:
        """Where MLX computes (`cpu`, or `gpu`: Metal), for the engine's stats."""
        return ident.device_name()

    @property
    def kv_bytes_per_token(self) -> int:
        return max(1, self.num_kv_layers) * 2 * self.num_kv_heads * self.kv_format.bytes_per_row

    def set_kv_dtype(self, name: str) -> None:
        """Hold KV as `name` in every sequence made from now on: `auto`, `bfloat16` or
        `float16` (a cast when stored, read back for attention, fresh or restored)."""
        fmt = kv_format(name, self.dtype, max(1, self.head_dim))
        if fmt.scaled:
            raise ModelNotSupportedError(f"kv_dtype {name!r}: {KV_INT8_REASON}")
        if fmt.name != "auto" and not self._stored:
            raise ModelNotSupportedError(
                f"kv_dtype {name!r} needs the MLX backend to keep {self.name}'s attention "
                f"caches itself, and it keeps mlx-lm's ({self.unsupported_reason}); use "
                "kv_dtype 'auto'"
            )
        self.kv_format = fmt

    def identity(self, block_size: int, deterministic: bool = False) -> dict[str, str]:
        """The namespace's fields (`cache.identity.NAMESPACE_FIELDS`) for this model on MLX."""
        if deterministic:
            raise ModelNotSupportedError(DETERMINISTIC_REASON)
        if self._static_identity is None:
            self._static_identity = {
                "layout": str(KV_LAYOUT_VERSION),
                "backend": ident.BACKEND,
                "weights": ident.mlx_weights_digest(self.model, self.model_dir),
                "config": ident.config_field(self.config),
                "dtype": str(self.dtype).removeprefix("torch."),
            }
        fmt = self.kv_format
        fields = {
            **self._static_identity,
            "device": ident.device_name(),
            "kv_dtype": self._static_identity["dtype"] if fmt.name == "auto" else fmt.name,
            "linear": self.linear_kernel,
            "attention": ident.attention_kernel(),
            "mode": "grouped" if self.batched else "one-sequence",
            "block_size": str(int(block_size)),
        }
        return {name: fields[name] for name in NAMESPACE_FIELDS}

    def fingerprint(self, block_size: int, deterministic: bool = False) -> str:
        return namespace_digest(self.identity(block_size, deterministic))

    def stable_rows(self) -> Callable[[int], int] | None:
        return None  # prompt chunks run alone; see DETERMINISTIC_REASON for the option

    # ---- KV -------------------------------------------------------------

    def new_kv(self, capacity: int) -> MlxSeqKV:
        """An empty sequence: mlx-lm's caches with every attention cache a growing
        `StoredKVCache` in the KV format (`layers`), or, for a model this backend does
        not cache, the cache objects mlx-lm makes for it."""
        make: Callable[[], list[Any]]
        if self._stored:
            storage, native = mx_dtype(self.kv_format.storage_dtype), self._native
            make = lambda: substituted(native, lambda: StoredKVCache(storage))  # noqa: E731
        else:
            make = lambda: make_prompt_cache(self.model)  # noqa: E731
        return MlxSeqKV(
            make, self.kv_layers, self.kv_format.storage_dtype, self.num_kv_heads,
            self.head_dim, capacity, self.state_layout,
        )  # fmt: skip

    # ---- compute --------------------------------------------------------

    def forward_step(
        self,
        chunks: list[SeqChunk],
        pad_rows: Callable[[int], int] | None = None,
        group_decode: bool = True,
    ) -> torch.Tensor:
        """Every chunk of one step; returns the float32 logits `[wanted, vocab]` of the
        chunks that want them, in chunk order. Prompt chunks run one per model call;
        decode rows all in one (`group_decode`, on a batched model, two or more)."""
        if pad_rows is not None:
            raise ModelNotSupportedError(DETERMINISTIC_REASON)
        seqs: list[MlxSeqKV] = []
        for chunk in chunks:
            if chunk.lora is not None:
                raise ModelNotSupportedError(LORA_REASON)
            if chunk.images or chunk.positions is not None:
                raise ModelNotSupportedError(IMAGES_REASON)
            kv = chunk.kv
            if not isinstance(kv, MlxSeqKV):
                raise TypeError(f"an MLX step got {type(kv).__name__} KV, not MlxSeqKV")
            kv.rewind(chunk.start)
            seqs.append(kv)
        decode = [i for i, c in enumerate(chunks) if not c.is_prompt]
        together = decode if self.batched and group_decode and len(decode) >= 2 else []
        last: dict[int, mx.array] = {}
        for i, chunk in enumerate(chunks):
            if i not in together:
                ids = mx.array([list(chunk.token_ids)])
                with last_row_only(self._last_row):
                    last[i] = self.model(ids, cache=seqs[i].caches)[0, -1]
        if together:
            rows = [seqs[i] for i in together]
            starts = [chunks[i].start for i in together]
            layers = [
                DecodeLayer([s.caches[j] for s in rows], starts) for j in range(self.num_layers)
            ]
            ids = mx.array([[chunks[i].token_ids[0]] for i in together])
            out = self.model(ids, cache=layers)
            for row, i in enumerate(together):
                last[i] = out[row, -1]
        for chunk, kv in zip(chunks, seqs, strict=True):
            kv.advance(len(chunk.token_ids))
        wanted = [last[i].astype(mx.float32) for i, c in enumerate(chunks) if c.want_logits]
        mx.eval(wanted, [[c.state for c in s.caches] for s in seqs])
        if not wanted:
            return torch.empty((0, self.vocab_size), dtype=torch.float32)
        return to_torch(mx.stack(wanted))

    def warmup(self) -> None:
        """A short prefill and a decode step on a throwaway sequence (MLX compiles its
        kernels on first use)."""
        ids = self.encode("warm up") or [0]
        kv = self.new_kv(len(ids) + 1)
        self.forward_step([SeqChunk(kv, 0, ids, True)])
        self.forward_step([SeqChunk(kv, len(ids), ids[:1], True)])

    def compile_decode(self) -> None:
        raise ModelNotSupportedError(f"compile_decode: {COMPILE_REASON}")

    def close(self) -> None:
        """Drop the model's arrays, on the engine's worker thread as it ends. MLX arrays
        made on a thread that has ended and still alive at interpreter exit abort the
        process ("terminate called without an active exception": 3 of 12 exits of
        tests/engine/engine_worker.py on mlx-cpu 0.32.4); freed on their own thread
        first, none of 12 did."""
        self.model = None
        self._native = []
        gc.collect()
        mx.synchronize()

    def __repr__(self) -> str:
        return (
            f"MlxBackend({self.name!r}, device={ident.device_name()}, dtype={self.dtype}, "
            f"linear={self.linear_kernel}, layers={self.num_layers}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"prefix_caching={'on' if self.prefix_caching_supported else 'off'})"
        )


def _eos_token_ids(generation_config: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings as mlx-lm's models read them (`rope_theta`, `partial_rotary_factor`,
    `rope_scaling` at the top level) from a config that transformers 5 wrote
    (`rope_parameters`). mlx-lm's Llama and Qwen read only the top-level names and
    otherwise take theta 10000: the bundled SmolLM2 (theta 100000, written by
    transformers 5 when converted) ran with the wrong positions until this; its
    Qwen3-Next requires `partial_rotary_factor` there and would not load."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" in config:
        return {}
    fields: dict[str, Any] = {}
    for name in ("rope_theta", "partial_rotary_factor"):  # Qwen3-Next needs the factor
        if name in params and name not in config:
            fields[name] = params[name]
    if params.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        fields["rope_scaling"] = dict(params)
    return fields


def load_mlx_model(directory: Path, name: str) -> MlxBackend:
    """Load a resolved model directory (`model.resolve`) through mlx-lm, with
    transformers' tokenizer and generation config. Never touches the network."""
    from mlx_lm.utils import load_model as mlx_load_model
    from transformers import AutoTokenizer, GenerationConfig

    config = json.loads((directory / "config.json").read_text())
    try:
        model, _ = mlx_load_model(directory, model_config=rope_fields(config))
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        # TypeError: mlx-lm's model arguments lack a field its code wants (a config
        # written by a transformers version whose field names mlx-lm does not read).
        raise ModelNotSupportedError(
            f"cannot load {str(directory)!r} through mlx-lm ({type(exc).__name__}: {exc}); "
            "use --backend torch"
        ) from exc
    try:
        generation = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError):
        generation = None
    backend = MlxBackend(
        model, tokenizer, config, name=name, model_dir=directory, generation_config=generation
    )
    logger.info("loaded %r", backend)
    return backend
