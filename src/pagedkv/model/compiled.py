"""A compiled decode step: a plain decoder's one-token rows through AOTInductor.

A decode step of the bundled model spends much of its time outside the linear
products: 30 layers of small operations (norms, rotary embedding, the MLP's
element-wise work, views) dispatched one at a time from Python and
transformers' modules. Inductor generates C++ that fuses each layer's
element-wise work into a few loops.

What is compiled: `decode_layer`, one decoder layer's decode rows (RMS norms,
rotary positions, a SiLU-gated MLP; llama, mistral without a window, qwen2,
qwen3) written here over the model's own tensors, which it takes as inputs
(`_LayerArgs`): every layer has the same shapes, so one compiled layer serves
all of them. `DecodeStep` runs the embedding, the rotary angles and the output
layer eagerly (a few operations) and the layers through it. The linear products:
- 4-bit layers (`model.int4`) inside the generated code: the kernel
  `_weight_int4pack_mm_for_cpu` over their tensors, q/k/v and gate/up
  concatenated along the outputs (one product instead of three and two);
- other layers as an opaque op (`pagedkv::linear`) that calls a registered
  layer by index (a 0-d tensor input: one layer's index is not a constant of the
  code), with the kernel the eager path uses (oneDNN over packed weights, which
  inductor cannot take as inputs): the model's own o and down projections, and
  fused copies of q/k/v and gate/up (~20 us a call saved, for ~two thirds of the
  weights' bytes again in memory). Rejected: inductor's `freezing`, which packs
  its own copy of every weight and whose packed constants its disk cache cannot
  store (every start compiled again: 90-105 s for the bundled model here).
Attention is an opaque op too (`pagedkv::decode_attention`): the ragged batch's
(`model.batch.ragged_attention`), which writes each row's keys and values into
its sequence's buffer and attends with the grouped decode attention. So the
layer's shapes depend on its number of rows only, never on a context length or
a buffer, and the rows are a dynamic size of the export: one compiled layer for
every row count, never compiled again while serving.

Ahead of time: `torch.export` and AOTInductor build a package (`.pt2`: the
generated code as a shared library) under the user cache's `compiled/`, named by
what it depends on (`package_key`: the compiler, the CPU instructions, this file,
the model's shapes and input dtypes; not the weights). A restart loads it: no
trace, no compile (measured for the bundled model: built in ~11-30 s, loaded in
0.1-0.2 s; a first answer 7.8 s after launch with `--dtype int4`). Rejected:
`torch.compile` of the whole step, whose warm start re-traces the 30 layers
(13-15 s, and its per-call guards cost ~20% of a layer's time).

Which steps: those whose every chunk is one decode row with no LoRA adapter, in
the default batching mode. A step with a prompt chunk runs eagerly; so does
every step in deterministic mode, where a row must round alike whatever else
runs. A compiled row rounds otherwise than an eager one (fused element-wise
work), so the compiled step is part of the namespace's `mode`
(`ModelAdapter.identity`): KV decoded one way is never restored into a run that
decodes the other way. Cached == fresh holds within the mode: a prompt's rows
are computed eagerly either way, and decode rows are decode rows whether their
prompt was cached or not.

Fallback: a model this step does not describe (`compile_reason`), a build or
load that fails (no C++ compiler, an op inductor cannot lower) or a compiled
step whose logits disagree with the eager forward's leaves the step eager, with
the reason logged and kept (`CompiledDecode.reason`): never a failed start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import typing
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.model.batch import RaggedPlan, SeqChunk, plan_batch, ragged_attention
from pagedkv.model.int4 import INT4_GROUP, Int4Linear, int4_side_by_side
from pagedkv.model.linear import INT8_KERNEL, pack_linear
from pagedkv.storage.ssd.ownership import check_directory, make_private_dir

log = logging.getLogger(__name__)

# The row counts run at start-up (the last is the example the layer is exported at).
COMPILED_ROWS = (1, 2)
# What the packages' folder is, and what a writer to it could do.
_PACKAGES = ("compiled decode directory", "run code in the server")
# The most rows the exported layer takes (a step's decode rows: one per running sequence).
_MAX_ROWS = 1 << 16
# Model types whose decoder `DecodeStep` computes, layer for layer.
_PLAIN_DECODERS = ("llama", "mistral", "qwen2", "qwen3")
# Bumped when `DecodeStep` computes otherwise (part of the namespace's `mode`).
_STEP_VERSION = 1

# The plan of the step being computed on this thread: the attention op reads it (each
# engine's worker thread computes its own steps).
_running = threading.local()


# The packed linear layers compiled steps call (`pagedkv::linear`), by index, so the
# graph holds no oneDNN-packed weight (inductor cannot take one as an input): the
# model's own modules and the fused copies its `DecodeStep` holds. Weak references: a
# model let go takes its layers with it.
_linears: list[weakref.ref[torch.nn.Module]] = []


def _register(module: torch.nn.Module) -> torch.Tensor:
    """`module`'s index among `_linears`, as the 0-d tensor the graph passes on."""
    _linears.append(weakref.ref(module))
    return torch.tensor(len(_linears) - 1)


@torch.library.custom_op("pagedkv::linear", mutates_args=())
def linear(x: torch.Tensor, index: torch.Tensor, out_features: int) -> torch.Tensor:
    """`x [rows, in]` through the registered linear layer `index` (`_register`)."""
    module = _linears[int(index)]()
    assert module is not None, "a compiled step outlived its model"
    return typing.cast(torch.Tensor, module(x))


@linear.register_fake
def _(x: torch.Tensor, index: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


class _Layer:
    """What `ragged_attention` reads of an attention module: its layer index."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


@torch.library.custom_op("pagedkv::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows `q [B, heads, head_dim]`, `k` and `v` `[B, kv_heads, head_dim]`, one per decode
    chunk of the running plan: each row's keys and values go into its sequence's
    buffer (of KV layer `layer`, a 0-d tensor), and its attention output comes back
    `[B, heads * head_dim]`."""
    plan: RaggedPlan = _running.plan
    n = plan.num_rows
    query = q.transpose(0, 1).unsqueeze(0)
    key = k.transpose(0, 1).unsqueeze(0)
    value = v.transpose(0, 1).unsqueeze(0)
    out, _ = ragged_attention(
        _Layer(int(layer)),  # type: ignore[arg-type]
        query,
        key,
        value,
        None,
        scaling=scale,
        pagedkv_plan=plan,
    )
    return out[0].reshape(n, -1)


@decode_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def compile_reason(
    model: Any, batched: bool, windows: Sequence[int | None], linear_kernel: str
) -> str | None:
    """Why `model`'s decode step cannot be compiled here (`windows`: its KV layers'
    sliding windows; `linear_kernel`: `ModelAdapter.linear_kernel`); None if it can."""
    config = model.config
    text = config.get_text_config(decoder=True)
    kind = getattr(text, "model_type", None)
    if kind not in _PLAIN_DECODERS:
        return f"the compiled step computes {', '.join(_PLAIN_DECODERS)} decoders, not {kind}"
    if not batched:
        return "the model runs one sequence per forward, not in the ragged batch"
    if any(w is not None for w in windows):
        return "sliding-window layers"
    if linear_kernel == INT8_KERNEL:
        # Its layers share one input's codes, keyed on the input tensor object, and the
        # generated code reuses an object for another activation (measured: logits off
        # by ~9 on a tiny llama).
        return "int8 weights (their layers share input codes by tensor object)"
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"activation {text.hidden_act}"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    fixed = ("default", "linear", "llama3")  # a frequency table set once, at load
    if rotary is None or getattr(rotary, "rope_type", "default") not in fixed:
        return "rotary positions other than a fixed frequency table"
    if getattr(model, "lm_head", None) is None:
        return "no lm_head"
    return None


# A linear layer as the compiled layer takes it: `(weight, scales_zeros, bias)` of 4-bit
# weights (`model.int4`), which the graph multiplies itself, or `(index,)` of a
# registered layer (`pagedkv::linear`).
Product = tuple[torch.Tensor, ...]


def _fused(*layers: Any) -> torch.nn.Module:
    """One packed (or plain) linear layer computing `layers`' outputs side by side."""
    weights = [layer.weight for layer in layers]
    packed = any(w.is_mkldnn for w in weights)
    dense = torch.cat([w.to_dense() if w.is_mkldnn else w.detach() for w in weights])
    biases = [layer.bias for layer in layers]
    fused = torch.nn.utils.skip_init(
        torch.nn.Linear, dense.shape[1], dense.shape[0], bias=biases[0] is not None
    )
    fused.requires_grad_(False)
    fused.weight.data = dense
    if fused.bias is not None:
        fused.bias.data = torch.cat([b.detach() for b in biases])
    if packed:
        pack_linear(fused)
    return fused


def _product_of(layers: Sequence[Any], keep: list[torch.nn.Module]) -> Product:
    """How the compiled layer multiplies by `layers`' outputs side by side (q, k and v;
    gate and up: one product instead of two or three, each a call with a fixed cost),
    or by one layer. 4-bit layers (`model.int4`) as their tensors, side by side along
    the outputs (`int4_side_by_side`, a copy); other layers
    registered by index, fused into a copy packed for oneDNN as the model's own are
    (`model.linear`; kept alive in `keep`)."""
    if all(isinstance(layer, Int4Linear) for layer in layers):
        return int4_side_by_side(layers)
    module = layers[0] if len(layers) == 1 else _fused(*layers)
    keep.append(module)
    return (_register(module),)


def _product(x: torch.Tensor, product: Product, out_features: int) -> torch.Tensor:
    if len(product) == 1:
        return torch.ops.pagedkv.linear(x, product[0], out_features)
    weight, scales_zeros, bias = product
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales_zeros)
    return y + bias if bias.numel() else y


class _Shape(typing.NamedTuple):
    """What every layer of one model shares: constants of the compiled layer."""

    head_dim: int
    qkv: tuple[int, int, int]  # q, k and v's widths
    hidden: int
    intermediate: int
    eps: float
    scale: float
    q_norm: bool  # qwen3's norms of q and k


class _LayerArgs(typing.NamedTuple):
    """One decoder layer as the compiled layer takes it: tensors only, alike in shape
    from layer to layer, so one graph serves them all."""

    layer: torch.Tensor  # its KV layer's index, 0-d
    norm1: torch.Tensor
    norm2: torch.Tensor
    q_norm: torch.Tensor  # empty where the model has none
    k_norm: torch.Tensor
    qkv: Product
    o: Product
    gate_up: Product
    down: Product


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def decode_layer(
    shape: _Shape, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a: _LayerArgs
) -> torch.Tensor:
    """One decoder layer over decode rows `h [B, hidden]`: what is compiled."""
    b, hd = h.shape[0], shape.head_dim
    x = _rms(h, a.norm1, shape.eps)
    q, k, v = _product(x, a.qkv, sum(shape.qkv)).split(list(shape.qkv), -1)
    q, k, v = q.view(b, -1, hd), k.view(b, -1, hd), v.view(b, -1, hd)
    if shape.q_norm:
        q, k = _rms(q, a.q_norm, shape.eps), _rms(k, a.k_norm, shape.eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    o = torch.ops.pagedkv.decode_attention(q, k, v, a.layer, shape.scale)
    h = h + _product(o, a.o, shape.hidden)
    x = _rms(h, a.norm2, shape.eps)
    n = shape.intermediate
    gate, up = _product(x, a.gate_up, 2 * n).split([n, n], -1)
    return h + _product(F.silu(gate) * up, a.down, shape.hidden)


class DecodeStep(torch.nn.Module):
    """One decode row per sequence: `forward(ids [B], positions [B])` gives the float32
    logits `[B, vocab]`, each row's keys and values written by the attention op. The
    embedding, rotary angles and output layer run eagerly (a few operations); each
    decoder layer through `package` (`decode_layer` compiled once for all the layers;
    `decode_layer` itself until then). It holds the model's own tensors and linear
    layers, and fused copies of q/k/v and gate/up."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        text = model.config.get_text_config(decoder=True)
        inner = model.model
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        first = inner.layers[0]
        a, mlp = first.self_attn, first.mlp
        self.shape = _Shape(
            head_dim=head_dim,
            qkv=(a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features),
            hidden=int(a.o_proj.out_features),
            intermediate=int(mlp.up_proj.out_features),
            eps=float(text.rms_norm_eps),
            scale=float(a.scaling),
            q_norm=getattr(a, "q_norm", None) is not None,
        )
        # The fused copies, the layers the graph calls by index (weakly registered).
        self.kept: list[torch.nn.Module] = []
        self.layers = [self._args(i, layer) for i, layer in enumerate(inner.layers)]
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm
        self.lm_head = model.lm_head
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        # Each layer's inputs as the package takes them, flat.
        self.flat = [_leaves(args) for args in self.layers]
        self.package: Any = None  # the compiled layer (`CompiledDecode.compile`); None: eager

    def _args(self, i: int, layer: Any) -> _LayerArgs:
        a, mlp, keep = layer.self_attn, layer.mlp, self.kept
        none = torch.empty(0)
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return _LayerArgs(
            layer=torch.tensor(i),
            norm1=layer.input_layernorm.weight,
            norm2=layer.post_attention_layernorm.weight,
            q_norm=none if q_norm is None else q_norm.weight,
            k_norm=none if k_norm is None else k_norm.weight,
            qkv=_product_of([a.q_proj, a.k_proj, a.v_proj], keep),
            o=_product_of([a.o_proj], keep),
            gate_up=_product_of([mlp.gate_proj, mlp.up_proj], keep),
            down=_product_of([mlp.down_proj], keep),
        )

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.embed)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos = (emb.cos() * self.rope_scale).to(h.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scale).to(h.dtype)[:, None, :]
        for args, flat in zip(self.layers, self.flat, strict=True):
            if self.package is None:
                h = decode_layer(self.shape, h, cos, sin, args)
            else:
                h = self.package.boxed_run([h, cos, sin, *flat])[0]
        return typing.cast(torch.Tensor, self.lm_head(self.norm(h))).float()


def is_decode_step(chunks: Sequence[SeqChunk]) -> bool:
    """Whether every chunk is one decode row the compiled step computes."""
    return all(
        not c.is_prompt and c.lora is None and not c.images and c.positions is None for c in chunks
    )


class _Exported(torch.nn.Module):
    """`decode_layer` as `torch.export` takes it: tensors (in nested tuples) in, `h` out."""

    def __init__(self, shape: _Shape) -> None:
        super().__init__()
        self.shape = shape

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, args: tuple[Any, ...]
    ) -> torch.Tensor:
        return decode_layer(self.shape, h, cos, sin, _LayerArgs(*args))


class CompiledDecode:
    """The decode step's layer compiled once, ahead of time, for any number of rows;
    `reason` says why it is not in use (None: it is)."""

    def __init__(self, model: Any, directory: Path) -> None:
        self.reason: str | None = None
        self.loaded = False  # the package was on disk (not built now)
        self.seconds = 0.0  # building or loading it, and its first steps
        self.steps = 0  # decode steps computed compiled
        self._step = DecodeStep(model).eval()
        self.path = directory / f"{self.package_key()}.pt2"

    @property
    def active(self) -> bool:
        return self._step.package is not None and self.reason is None

    def signature(self) -> str:
        """What the namespace's `mode` names: the compiler, its version, the CPU
        instructions its code was generated for (they round otherwise), the step's."""
        cpu = torch.backends.cpu.get_cpu_capability().lower()
        return f"aotinductor:torch-{torch.__version__}:{cpu}:v{_STEP_VERSION}"

    def package_key(self) -> str:
        """What the compiled layer depends on: the signature, this file's code, the
        model's shape constants and each input's dtype and size (not the weights:
        inputs)."""
        args = [(str(t.dtype), tuple(t.shape)) for t in _leaves(self._step.layers[0])]
        text = repr((self.signature(), tuple(self._step.shape), args))
        digest = hashlib.sha256(Path(__file__).read_bytes())
        digest.update(text.encode())
        return digest.hexdigest()[:24]

    def compile(
        self,
        new_buffer: Callable[[int], torch.Tensor],
        kv_format: Any,
        device: torch.device,
        check: Callable[[CompiledDecode], str | None],
    ) -> None:
        """Load the layer's package from disk, or build it there (`build`); run
        `COMPILED_ROWS` rows over throwaway buffers from `new_buffer(capacity)`, then
        `check(self)`: why the compiled step disagrees with the eager forward, or None.
        On any failure the step stays eager (`reason`)."""
        started = time.perf_counter()
        try:
            # A package is code the server runs: never from a folder others may write.
            check_directory(self.path.parent, _PACKAGES)
            package = None
            if self.path.is_file():
                try:
                    package = _load(self.path)
                    self.loaded = True
                except Exception as exc:  # a damaged file: built again
                    log.warning("decode step: package %s did not load (%s)", self.path, exc)
                    self.path.unlink(missing_ok=True)
            if package is None:
                self.build()
                package = _load(self.path)
            self._step.package = package
            for rows in COMPILED_ROWS:
                chunks = [SeqChunk(new_buffer(4), 1, [0], True) for _ in range(rows)]
                self(chunks, kv_format, device)
            self.reason = check(self)
        except Exception as exc:  # any compiler failure: stay eager
            self.reason = f"compiling failed ({type(exc).__name__}: {exc})"
        self.seconds = time.perf_counter() - started
        if self.reason is not None:
            log.warning("the decode step stays eager: %s", self.reason)
            self._step.package = None
        else:
            how = "loaded" if self.loaded else "built"
            log.info("decode step: layer package %s in %.1f s (%s)", how, self.seconds, self.path)

    def build(self) -> None:
        """Export `decode_layer` with the rows dynamic and compile it with AOTInductor
        into `path` (written whole, then renamed: a concurrent start never loads half)."""
        step = self._step
        b = COMPILED_ROWS[-1]  # an example size torch.export does not specialize
        hidden, hd = step.shape.hidden, step.shape.head_dim
        h = torch.zeros(b, hidden, dtype=step.embed.dtype)
        cos = torch.zeros(b, 1, hd, dtype=step.embed.dtype)
        args = tuple(step.layers[0])
        rows = torch.export.Dim("rows", min=1, max=_MAX_ROWS)
        dims = {"h": {0: rows}, "cos": {0: rows}, "sin": {0: rows}}
        dims["args"] = torch.utils._pytree.tree_map(lambda _: None, args)
        with torch.inference_mode():
            exported = torch.export.export(
                _Exported(step.shape), (h, cos, cos.clone(), args), dynamic_shapes=dims,
                strict=False,
            )  # fmt: skip
        make_private_dir(self.path.parent)
        partial = self.path.with_suffix(f".{os.getpid()}.partial.pt2")
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            os.replace(partial, self.path)
        finally:
            partial.unlink(missing_ok=True)

    def __call__(
        self, chunks: list[SeqChunk], kv_format: Any, device: torch.device
    ) -> torch.Tensor:
        """The float32 logits `[wanted, vocab]` of one decode step (`is_decode_step`)."""
        plan, ids, positions, keep = plan_batch(chunks, None, device, kv_format, True)
        _running.plan = plan
        try:
            with torch.inference_mode():
                logits = self._step(ids[0], positions[0])
        finally:
            _running.plan = None
        self.steps += 1
        return logits[keep]


def _load(path: Path) -> Any:
    """The package at `path`, through torch's loader itself: `aoti_load_package` first
    probes which vector instructions the CPU runs (2-2.5 s of subprocesses here) only
    to warn where they differ from the build's, which the package's name includes, and
    its call parses the package's input layout every time."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)


def _leaves(args: _LayerArgs) -> list[torch.Tensor]:
    return typing.cast(list[torch.Tensor], torch.utils._pytree.tree_leaves(tuple(args)))
