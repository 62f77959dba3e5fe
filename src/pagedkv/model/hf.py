"""Model adapter for Hugging Face transformers 5.x causal LMs.

The adapter is the only module that knows how transformers lays out its KV
cache. The engine sees per-layer `(keys, values)` tensors `[1, kv_heads,
tokens, head_dim]` and an opaque cache object it passes back to `forward`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import mmap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from pagedkv.cache.identity import NAMESPACE_FIELDS, namespace_digest
from pagedkv.config import DTYPES, cache_home
from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.batch import (
    ATTENTION_NAME,
    DeterministicRows,
    SeqChunk,
    linear_layers,
    plan_batch,
    ragged_kernel_name,
)
from pagedkv.model.bundled import BUNDLED_MODEL_NAME
from pagedkv.model.choose import mlx_quantization
from pagedkv.model.compiled import CompiledDecode, compile_reason, is_decode_step
from pagedkv.model.fingerprint import canonical_config, weights_digest
from pagedkv.model.generation_defaults import (
    BUNDLED_DEFAULTS,
    SamplingDefaults,
    read_sampling_defaults,
)
from pagedkv.model.int4 import INT4_KERNEL, quantize_linears_int4
from pagedkv.model.kinds import LayerKinds, read_layer_kinds
from pagedkv.model.kv_format import KVFormat, kv_format
from pagedkv.model.kv_layer import GrowableLayer
from pagedkv.model.linear import INT8_KERNEL, KERNEL, pack_linears, quantize_linears
from pagedkv.model.lora import LoraWeights
from pagedkv.model.lora_layers import LoraLayers, adapter_order, lora_groups, unpermute_wanted
from pagedkv.model.resolve import resolve_model
from pagedkv.model.state import StateLayout, cache_layer_problem, probe_state_layout
from pagedkv.model.text import TextMethods
from pagedkv.model.token_bound import max_chars_per_token
from pagedkv.model.torch_kv import BufferKV, CacheKV
from pagedkv.model.vision import (
    VisionModel,
    is_vision_config,
    load_vision_model,
    placements,
)

logger = logging.getLogger(__name__)

# Bumped whenever the meaning of stored KV changes (layout, rounding, RoPE
# handling); part of every fingerprint, so old blocks simply stop matching.
KV_LAYOUT_VERSION = 2  # 2: KV rows are the KV layers only; recurrent-state snapshots
# The compute library, in the namespace: another backend (MLX) rounds otherwise.
BACKEND = "torch"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _batch_mode(batched: bool, deterministic: bool) -> str:
    """How a step's rows are batched, as the namespace's `mode` names it."""
    if not batched:
        return "one-sequence"  # a forward per sequence: nothing else shares its rows
    return "deterministic" if deterministic else "grouped"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` → cuda when available, else cpu."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available; use 'cpu'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` → float32 on CPU (the exact choice; bfloat16 is faster only on CPUs that
    multiply it natively, and rounds coarser: `linear.pack_linears`), bfloat16
    on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "int8":
        if device.type != "cpu":
            raise ValueError("dtype 'int8' (int8 weights) runs on the CPU only; use device 'cpu'")
        return torch.float32
    if dtype == "int4":
        if device.type != "cpu":
            raise ValueError("dtype 'int4' (4-bit weights) runs on the CPU only; use device 'cpu'")
        return torch.bfloat16  # the int4 kernel's fast path takes bfloat16 rows only
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}; got {dtype!r}")
    return _DTYPES[dtype]


class ModelAdapter(TextMethods):
    """A loaded causal LM plus the tokenizer and the KV-cache plumbing the engine needs:
    the torch `model.backend.Backend` (`new_kv`, `forward_step`, `stable_rows`), over
    the lower-level `forward_batch` (ragged batch, KV buffers) and `forward`
    (transformers' own cache, one sequence) that the model tests call directly.

    Invariants: `forward` always runs under `torch.inference_mode()`, so cache
    tensors it produces are inference tensors (read them anywhere; write into
    them only inside inference mode). Caches from `new_cache`, `build_cache` and
    `cache_with_buffers` own their buffers (GrowableLayer): `build_cache` copies
    the tensors it is given, and `cache_with_buffers` hands out its memory to
    fill before the first forward. Not thread-safe: one worker owns the adapter.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        model_dir: Path | None = None,
        int8_weights: bool = False,
        int4_weights: bool = False,
        processor: Any = None,
    ) -> None:
        self.model = model
        # The compiled decode step (`model.compiled`), once `compile_decode` made it.
        self.compiled: CompiledDecode | None = None
        self.decode_path = "eager"
        # A VLM's image side (`model.vision`), given its processor; None: text only.
        self.vision: VisionModel | None = None
        if processor is not None:
            self.vision = VisionModel(model, processor)
        self.tokenizer = tokenizer
        # The most input characters one token covers, where provable (None: unknown).
        self.max_token_chars = max_chars_per_token(tokenizer)
        self.name = name
        self.backend_name = BACKEND
        self.model_dir = model_dir
        param = next(model.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.config = model.config
        text = model.config.get_text_config(decoder=True)
        self.num_layers: int = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        self.num_kv_heads: int = int(getattr(text, "num_key_value_heads", None) or heads)
        self.head_dim: int = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        self.vocab_size: int = int(text.vocab_size)
        self.max_context: int = int(
            getattr(text, "max_position_embeddings", None)
            or min(getattr(tokenizer, "model_max_length", 2048), 2048)
        )
        self.eos_token_ids: tuple[int, ...] = _eos_token_ids(model, tokenizer)
        # What the model recommends for fields a request leaves out; the bundled model
        # recommends nothing in its config, so it gets pagedkv's (generation_defaults).
        self.sampling_defaults: SamplingDefaults = read_sampling_defaults(
            getattr(model, "generation_config", None)
        )
        if name == BUNDLED_MODEL_NAME and self.sampling_defaults.source == "none":
            self.sampling_defaults = BUNDLED_DEFAULTS
        self.kv_format: KVFormat = kv_format("auto", self.dtype, self.head_dim)

        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if self._cache_kw not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        ):
            raise ModelNotSupportedError(
                f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                "pagedkv needs a transformers causal LM with a KV cache"
            )
        self._forward_kwargs: dict[str, Any] = {"use_cache": True}
        if "logits_to_keep" in params:
            self._forward_kwargs["logits_to_keep"] = 1

        self.kinds: LayerKinds = read_layer_kinds(model.config)
        # LoRA adapters installed on the linear layers (`model.lora_layers`); packing
        # below changes the layers' classes in place, so the modules it holds stay.
        self.lora_layers = LoraLayers(model)
        # Rows of every KV buffer and block: the layers that keep per-token KV.
        self.kv_layers: tuple[int, ...] = self.kinds.kv_layers
        self.num_kv_layers: int = len(self.kv_layers)
        self.kv_windows: tuple[int | None, ...] = self.kinds.kv_windows
        self.state_layers: tuple[int, ...] = self.kinds.state_layers
        self.unsupported_reason: str | None = self.kinds.unsupported
        if self.unsupported_reason is None:
            self.unsupported_reason = cache_layer_problem(self.new_cache().layers, self.kinds)
        self.state_layout: StateLayout | None = None
        if self.unsupported_reason is None and self.state_layers:
            self.state_layout = probe_state_layout(self, self.state_layers)
        self.prefix_caching_supported: bool = self.unsupported_reason is None
        self._static_identity: dict[str, str] | None = None
        self.unbatched_reason: str | None = self._use_ragged_attention(params)
        self.deterministic_reason: str | None = None  # one-sequence mode is deterministic too
        self.refused_features: dict[str, str] = {}
        self.batched: bool = self.unbatched_reason is None
        # The ragged batch's `BufferKV` is preallocated (on the CPU an anonymous mapping whose
        # pages cost their first touch, `engine.spares`); a transformers cache (`CacheKV`) grows
        # by itself and is not worth keeping.
        self.reuses_kv: bool = self.batched
        # The linear layers' kernel, in the identity: KV computed another way rounds otherwise.
        self.linear_kernel = "torch"
        if int8_weights:
            if not quantize_linears(model):
                raise ModelNotSupportedError(
                    f"dtype 'int8' found no float32 linear layer on the CPU in {name}"
                )
            self.linear_kernel = INT8_KERNEL
            logger.info("linear layers hold int8 weights")
        elif int4_weights:
            self._quantize_int4(model, name)
        elif pack_linears(model):
            self.linear_kernel = KERNEL
            logger.info("linear layers packed for oneDNN")

    def _quantize_int4(self, model: Any, name: str) -> None:
        """`--dtype int4`: 4-bit weights over bfloat16 activations (`model.int4`)."""
        made = quantize_linears_int4(model, self.dtype)
        if not made:
            raise ModelNotSupportedError(
                f"dtype 'int4' found no linear layer on the CPU in {name} with in-features a "
                "multiple of 32 and out-features a multiple of 16; use dtype 'bfloat16'"
            )
        self.linear_kernel = INT4_KERNEL
        logger.info("%d linear layers hold int4 weights (groups of 32)", made)
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            logger.warning(
                "dtype 'int4': this CPU has no native bfloat16 (AVX512-BF16 or AMX), where the "
                "int4 kernel has no fast path (its slow path measured ~25x slower a token "
                "on a bfloat16 CPU); it still serves, but dtype 'int8' is likely faster here"
            )

    # ---- identity -------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V, all KV layers, for one token as `kv_format` stores it."""
        return max(1, self.num_kv_layers) * 2 * self.num_kv_heads * self.kv_format.bytes_per_row

    def set_kv_dtype(self, name: str) -> None:
        """Hold KV as `name` (see `model.kv_format`) in every buffer made from now on.
        One format at a time: the engine sets it once, before its first request."""
        fmt = kv_format(name, self.dtype, self.head_dim)
        if fmt.name != "auto" and not self.batched:
            raise ModelNotSupportedError(
                f"kv_dtype {name!r} needs the ragged batch, and {self.name} runs through "
                f"transformers' own cache ({self.unbatched_reason}); use kv_dtype 'auto'"
            )
        self.kv_format = fmt

    def identity(self, block_size: int, deterministic: bool = False) -> dict[str, str]:
        """The namespace's fields (`cache.identity.NAMESPACE_FIELDS`): everything that
        decides the KV computed for given token ids. `deterministic`: the engine pads
        decode rows (`DeterministicRows`), which rounds them otherwise than grouped
        decode rows. Never the path (a moved or copied model keeps its cache), the
        tokenizer or the chat template (token ids are hashed, not text)."""
        if self._static_identity is None:
            self._static_identity = {
                "layout": str(KV_LAYOUT_VERSION),
                "backend": BACKEND,
                "weights": weights_digest(self.model, self.model_dir),
                "config": canonical_config(self.config),
                "dtype": str(self.dtype).removeprefix("torch."),
            }
        fmt = self.kv_format
        kv_dtype = self._static_identity["dtype"] if fmt.name == "auto" else fmt.name
        fields = {
            **self._static_identity,
            "device": self.device.type,
            "kv_dtype": kv_dtype,
            "linear": self.linear_kernel,
            "attention": self.attention_kernel,
            "mode": self._mode(deterministic),
            "block_size": str(int(block_size)),
        }
        return {name: fields[name] for name in NAMESPACE_FIELDS}

    def _mode(self, deterministic: bool) -> str:
        """The namespace's `mode`: how rows are batched, and a compiled decode step's
        signature when decode rows go through it (they round otherwise)."""
        mode = _batch_mode(self.batched, deterministic)
        # Compiled at start-up: the namespace stays this one if the step fails later
        # (its rows then decode eagerly, logged; `forward_batch`).
        if self.compiled is not None and not deterministic:
            mode += "+decode=" + self.compiled.signature()
        return mode

    @property
    def attention_kernel(self) -> str:
        """The attention that computes stored KV: the ragged batch's, with the shape
        family its prompt chunks are attended in (`model.batch`), or the model's own."""
        if self.batched:
            return ragged_kernel_name()
        return f"transformers:{self.config._attn_implementation}"

    def fingerprint(self, block_size: int, deterministic: bool = False) -> str:
        """Namespace of this model's KV blocks: the digest of `identity` (format 2,
        `cache.identity.namespace_digest`)."""
        return namespace_digest(self.identity(block_size, deterministic))

    # ---- KV cache -------------------------------------------------------

    def new_cache(self, capacity: int = 0) -> Any:
        """An empty transformers cache for this model; its attention layers append in
        place into buffers sized for `capacity` tokens (see GrowableLayer). Sliding
        layers too keep every token, as the ragged batch's buffers do: the prefix cache
        stores each block's KV for every layer, and a layer that dropped old tokens
        (transformers' DynamicSlidingWindowLayer, rejected here) could not supply them.
        The model's mask still limits what each sliding layer attends to."""
        cache = DynamicCache(config=self.config)
        for i in self.kv_layers:
            if type(cache.layers[i]) in (DynamicLayer, DynamicSlidingWindowLayer):
                cache.layers[i] = GrowableLayer(capacity)
        return cache

    def build_cache(
        self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], capacity: int = 0
    ) -> Any:
        """A cache holding a copy of the given per-layer KV, each `[1, kv_heads,
        tokens, head_dim]`, with room for `capacity` tokens in all."""
        if not self.prefix_caching_supported:
            raise ModelNotSupportedError(
                f"cannot restore KV into {self.name}: {self.unsupported_reason}"
            )
        if len(layers) != self.num_kv_layers:
            raise ValueError(
                f"build_cache got {len(layers)} layers, model has {self.num_kv_layers} KV layers"
            )
        num_tokens = layers[0][0].shape[2] if layers else 0
        cache = self.new_cache(max(capacity, num_tokens))
        expected = (1, self.num_kv_heads, self.head_dim)
        for i, (keys, values) in enumerate(layers):
            for t in (keys, values):
                if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                    raise ValueError(
                        f"layer {i}: KV shape {tuple(t.shape)}, expected "
                        f"[1, {self.num_kv_heads}, tokens, {self.head_dim}]"
                    )
                if t.shape[2] != num_tokens:
                    raise ValueError(f"layer {i}: {t.shape[2]} tokens, layer 0 has {num_tokens}")
            keys = keys.to(device=self.device, dtype=self.dtype)
            values = values.to(device=self.device, dtype=self.dtype)
            cache.layers[self.kv_layers[i]].update(keys, values)
        return cache

    def cache_with_buffers(self, capacity: int) -> tuple[Any, torch.Tensor]:
        """An empty cache whose KV layers keep their KV in one allocation, and that
        allocation as `[num_kv_layers, 2, kv_heads, capacity, head_dim]`, zero-filled
        (a sliding layer's restore leaves the tokens before its window untouched, and
        attention must see finite numbers there even where it masks them). A caller
        restoring a prefix writes its first tokens there, then `set_cache_length`:
        restoring straight into the buffers the model attends over saves a copy."""
        if not self.prefix_caching_supported:
            raise ModelNotSupportedError(
                f"cannot restore KV into {self.name}: {self.unsupported_reason}"
            )
        shape = (self.num_kv_layers, 2, 1, self.num_kv_heads, capacity, self.head_dim)
        if self.device.type == "cpu":
            buffers = mapped_empty(shape, self.dtype)  # fresh anonymous pages read as zeros
        else:
            buffers = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cache = self.new_cache(capacity)
        for row, i in enumerate(self.kv_layers):
            cache.layers[i].adopt(buffers[row, 0], buffers[row, 1], 0)
        return cache, buffers[:, :, 0]

    def set_cache_length(self, cache: Any, num_tokens: int) -> None:
        """Declare the first `num_tokens` of a `cache_with_buffers` cache filled."""
        for i in self.kv_layers:
            cache.layers[i].set_length(num_tokens)

    def cache_layers(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per KV layer `(keys, values)` `[1, kv_heads, tokens, head_dim]` of a cache (views)."""
        out = []
        for layer in (cache.layers[i] for i in self.kv_layers):
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
                empty = torch.empty(
                    (1, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype, device=self.device
                )
                out.append((empty, empty))
            else:
                out.append((layer.keys, layer.values))
        return out

    @staticmethod
    def cache_length(cache: Any) -> int:
        """Number of tokens a cache holds."""
        return int(cache.get_seq_length())

    # ---- batched compute ------------------------------------------------

    def _use_ragged_attention(self, params: Any) -> str | None:
        """Switch the model to ragged attention when its layers allow it and a probe
        forward agrees with the model's own attention; else why not (the model then
        runs one sequence per forward)."""
        reason = self.kinds.unbatched
        if reason is None and "logits_to_keep" not in params:
            reason = "its forward takes no logits_to_keep"
        if reason is not None:
            return reason
        ids = [(7 * i + 3) % self.vocab_size for i in range(12)]
        want, _ = self.forward(ids)
        own: str | dict[str, str] = self.config._attn_implementation
        ragged: str | dict[str, str] = ATTENTION_NAME
        if self.vision is not None:  # the language model only: the encoder keeps its own
            own = {"text_config": self.config.get_text_config(decoder=True)._attn_implementation}
            ragged = {"text_config": ATTENTION_NAME}
        try:
            self.model.set_attn_implementation(ragged)
            got = self.forward_batch([SeqChunk(self.new_kv_buffer(len(ids)), 0, ids, True)])[0]
        except Exception as exc:  # an attention module that passes what ragged lacks
            self.model.set_attn_implementation(own)
            return f"ragged attention failed on it ({type(exc).__name__}: {exc})"
        # Prompt chunks are attended in other blocks than the model's own call
        # (`model.batch`), which rounds otherwise: in a 16-bit dtype the logits then
        # differ by a few of its last places of their largest (measured on the bundled
        # model in bfloat16: 0.31 of 26), where a wrong mask moves them by whole units.
        atol = 1e-3
        if self.dtype != torch.float32:
            atol = 4 * torch.finfo(self.dtype).eps * float(want.abs().max())
        if not torch.allclose(got, want, rtol=1e-3, atol=atol):
            self.model.set_attn_implementation(own)
            return "ragged attention disagrees with the model's own attention"
        return None

    def new_kv_buffer(self, capacity: int) -> torch.Tensor:
        """An empty KV buffer for one sequence, `[num_kv_layers, 2, kv_heads, capacity,
        row_width]` of `kv_format`'s storage dtype (row_width is head_dim but for 8-bit
        KV; the ragged batch runs only models whose every layer keeps KV)."""
        fmt = self.kv_format
        shape = (self.num_kv_layers, 2, self.num_kv_heads, capacity, fmt.row_width)
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=fmt.storage_dtype, device=self.device)
        return mapped_empty(shape, fmt.storage_dtype)

    def forward_batch(
        self,
        chunks: list[SeqChunk],
        pad_rows: Callable[[int], int] | None = None,
        group_decode: bool = True,
    ) -> torch.Tensor:
        """One forward over every chunk (see `model.batch`); each chunk's KV lands in its
        buffer. Returns the float32 logits `[wanted, vocab]` of the chunks that want
        them, in chunk order. `pad_rows` pads the batch (`DeterministicRows`);
        `group_decode`: attend the decode rows in one call (see `RaggedPlan`)."""
        compiled = self.compiled
        if (
            compiled is not None
            and compiled.active
            and pad_rows is None
            and group_decode
            and is_decode_step(chunks)
        ):
            try:
                return compiled(chunks, self.kv_format, self.device)
            except Exception as exc:  # a recompile that fails: eager from now on
                logger.exception("the compiled decode step failed; decoding eagerly from now on")
                compiled.reason = f"failed while serving ({type(exc).__name__}: {exc})"
                self.decode_path = f"eager (the compiled step {compiled.reason})"
        # Rows of one adapter side by side, so each adapter's rows are one slice
        # (`model.lora_layers`); the logits go back to the caller's order below.
        order = adapter_order([c.lora for c in chunks])
        if order is not None:
            chunks = [chunks[i] for i in order]
        plan, ids, positions, keep = plan_batch(
            chunks, pad_rows, self.device, self.kv_format, group_decode
        )
        wanted = sum(c.want_logits for c in chunks)
        groups = []
        if any(c.lora is not None for c in chunks):
            lengths = [len(c.token_ids) for c in chunks]
            loras = [c.lora for c in chunks]
            groups = lora_groups(loras, plan.offsets, lengths, self.device)
        placed = placements(chunks, plan.offsets) if self.vision is not None else []
        with torch.inference_mode(), self.lora_layers.route(groups):
            inputs = {"input_ids": ids}
            if placed:
                assert self.vision is not None
                inputs = {"inputs_embeds": self.vision.embed(ids, placed)}
            out = self.model(
                **inputs,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=keep,
                pagedkv_plan=plan,
            )
        logits = out.logits[0, :wanted].float()
        if order is not None:
            logits = logits[unpermute_wanted(order, [c.want_logits for c in chunks])]
        return logits

    # ---- the seam (`model.backend.Backend`) ------------------------------

    def new_kv(self, capacity: int) -> BufferKV | CacheKV:
        """A sequence's KV with room for `capacity` tokens (`model.torch_kv`): a ragged
        batch buffer, or a transformers cache where the model runs one at a time."""
        if self.batched:
            return BufferKV(self.new_kv_buffer(capacity), self.new_kv_buffer)
        return CacheKV(self, capacity)

    def forward_step(
        self,
        chunks: list[SeqChunk],
        pad_rows: Callable[[int], int] | None = None,
        group_decode: bool = True,
    ) -> torch.Tensor:
        """Every chunk of one step, each `kv` a `new_kv` of this adapter; the float32
        logits `[wanted, vocab]` of the chunks that want them, in chunk order. Unbatched
        (`batched` False): exactly one chunk, through `forward`."""
        if self.batched:
            bare = [dataclasses.replace(c, kv=c.kv.buffer) for c in chunks]
            return self.forward_batch(bare, pad_rows, group_decode)
        if len(chunks) != 1:
            raise ValueError(
                f"{self.name} computes one sequence per forward ({self.unbatched_reason}); "
                f"forward_step got {len(chunks)} chunks: give it one at a time"
            )
        chunk, kv = chunks[0], chunks[0].kv
        logits, kv.cache = self.forward(chunk.token_ids, kv.for_forward(), chunk.lora)
        return logits.unsqueeze(0) if chunk.want_logits else logits.new_empty((0, len(logits)))

    def stable_rows(self) -> DeterministicRows | None:
        """The row counts the linear layers round alike at, measured now (batched models
        only: a model run one sequence at a time has no rows to pad)."""
        return DeterministicRows(linear_layers(self.model)) if self.batched else None

    def compile_decode(self) -> None:
        """Compile the decode step (`model.compiled`) on the thread that computes, before
        the namespace is read (the step is in its `mode`). Where it cannot be compiled or
        disagrees with the eager forward, decode stays eager with a warning
        (`decode_path` says why): never a failed start."""
        reason = compile_reason(self.model, self.batched, self.kv_windows)
        if reason is None:
            try:
                compiled = CompiledDecode(self.model, cache_home() / "compiled")
            except Exception as exc:  # a layer that is not what `DecodeStep` reads
                reason = f"its layers are not a plain decoder's ({type(exc).__name__}: {exc})"
            else:
                # `compile` logs its own warning when it stays eager
                compiled.compile(self.new_kv_buffer, self.kv_format, self.device, self._disagrees)
                if compiled.reason is None:
                    self.compiled = compiled
                    how = "loaded" if compiled.loaded else "built"
                    self.decode_path = (
                        f"compiled ({compiled.signature()}; {how} in {compiled.seconds:.1f} s)"
                    )
                else:
                    self.decode_path = f"eager (not compiled: {compiled.reason})"
                return
        logger.warning("the decode step stays eager: %s", reason)
        self.decode_path = f"eager (not compiled: {reason})"

    def _disagrees(self, compiled: CompiledDecode) -> str | None:
        """Why `compiled`'s decode logits differ from the eager forward's on a probe
        (a 12-token prompt, then one decode row), or None when they agree within the
        rounding of another kernel order."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(12)]
        kv = self.new_kv_buffer(len(ids))
        self.forward_batch([SeqChunk(kv, 0, ids[:-1], False)])
        twin = kv.clone()
        want = self.forward_batch([SeqChunk(kv, len(ids) - 1, ids[-1:], True)])
        got = compiled([SeqChunk(twin, len(ids) - 1, ids[-1:], True)], self.kv_format, self.device)
        atol = 1e-3 * max(1.0, float(want.abs().max()))
        if self.dtype != torch.float32:
            atol = 16 * torch.finfo(self.dtype).eps * float(want.abs().max())
        if not torch.allclose(got, want, rtol=0, atol=atol):
            diff = float((got - want).abs().max())
            return f"its logits differ from the eager forward's by {diff:.3g} (allowed {atol:.3g})"
        return None

    # ---- compute --------------------------------------------------------

    def forward(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        cache: Any = None,
        lora: LoraWeights | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Run `input_ids` after the tokens already in `cache` (None = empty cache),
        through the LoRA adapter `lora` (installed; None: the base model).

        Returns the float32 logits of the last position `[vocab]` and the cache,
        which now also holds `input_ids`.
        """
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids.to(device=self.device, dtype=torch.long).reshape(1, -1)
        else:
            ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        if ids.shape[1] == 0:
            raise ValueError("forward needs at least one input token")
        if cache is None:
            cache = self.new_cache()
        rows = ids.shape[1]
        groups = [] if lora is None else lora_groups([lora], [0], [rows], self.device)
        with torch.inference_mode(), self.lora_layers.route(groups):
            out = self.model(input_ids=ids, **{self._cache_kw: cache}, **self._forward_kwargs)
        logits = out.logits[0, -1].float()
        new_cache = out.cache if self._cache_kw == "cache" else out.past_key_values
        return logits, new_cache

    def warmup(self) -> None:
        """Run a short prefill and a decode step on a throwaway cache.

        The first forward of a process pays ~1-2 s of one-time costs (transformers'
        lazily imported mask/attention code, kernel selection); calling this at
        start-up keeps them out of the first request's TTFT.
        """
        ids = self.encode("warm up") or [0]
        if self.batched:
            kv = self.new_kv_buffer(len(ids) + 1)
            self.forward_batch([SeqChunk(kv, 0, ids, True)])
            self.forward_batch([SeqChunk(kv, len(ids), ids[:1], True)])
            return
        _, cache = self.forward(ids, None)
        self.forward(ids[:1], cache)

    def close(self) -> None:
        """Nothing to free: torch's tensors may die on any thread."""

    def __repr__(self) -> str:
        return (
            f"ModelAdapter({self.name!r}, device={self.device}, dtype={self.dtype}, "
            f"linear={self.linear_kernel}, layers={self.num_layers}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"prefix_caching={'on' if self.prefix_caching_supported else 'off'})"
        )


def mapped_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in its own anonymous memory map, unmapped when the
    last view of it goes. Rejected: `torch.empty`, whose large blocks glibc moves
    into its heap after the first few frees (its mmap threshold grows up to 32 MiB),
    where a freed sequence's KV stays in the process's memory and the KV budget no
    longer bounds what the process holds."""
    count = math.prod(shape)
    nbytes = max(1, count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def load_model(
    name_or_path: str | Path = BUNDLED_MODEL_NAME,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
) -> ModelAdapter:
    """Load the model `--model` names (`model.resolve`): the bundled model, a local
    Hugging Face directory, a .gguf file or a Hub id in the local Hugging Face cache.

    Never touches the network: everything is read with `local_files_only=True`.
    """
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    text = str(name_or_path)
    resolved = resolve_model(name_or_path)
    directory, name = resolved.directory, resolved.name
    if (quant := mlx_quantization(directory)) is not None:
        raise ModelNotSupportedError(
            f"cannot load {text!r} with the torch backend: it is an MLX-quantized model "
            f"(config.json has quantization {quant}); serve it with --backend mlx"
        )
    model: Any
    processor: Any = None
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError, KeyError):
        config = None  # the loader below says what is wrong
    if config is not None and is_vision_config(config):
        model, processor = load_vision_model(directory, torch_dtype)
        tokenizer = processor.tokenizer
    else:
        model, tokenizer = _load_causal_lm(directory, torch_dtype, text)
    model.to(target)
    model.eval()
    adapter = ModelAdapter(
        model,
        tokenizer,
        name=name,
        model_dir=directory,
        int8_weights=dtype == "int8",
        int4_weights=dtype == "int4",
        processor=processor,
    )
    logger.info("loaded %r", adapter)
    return adapter


def _load_causal_lm(directory: Path, torch_dtype: torch.dtype, text: str) -> tuple[Any, Any]:
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch_dtype, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelNotSupportedError(
            f"cannot load {text!r} as a transformers causal LM with its tokenizer: {exc}"
        ) from exc
    return model, tokenizer
