"""A compiled decode step: a plain decoder's one-token rows through torch.compile.

A decode step of the bundled model spends much of its time outside the linear
products: 30 layers of small operations (norms, rotary embedding, the MLP's
element-wise work, views) dispatched one at a time from Python and
transformers' modules. Inductor traces the step and generates C++ that fuses
each layer's element-wise work into a few loops.

What is compiled: `DecodeStep`, the decode forward of a plain decoder (RMS
norms, rotary positions, a SiLU-gated MLP; llama, mistral without a window,
qwen2, qwen3) written here over the model's own tensors. Two things stay
outside the generated code, as opaque ops the graph calls:
- the linear products (`pagedkv::linear`): layers by index, with the kernel the
  eager path uses (oneDNN over packed weights): the model's own
  o and down projections and output layer, and fused copies of q/k/v and of
  gate/up (one product each instead of three and two: ~20 us a call saved,
  for ~two thirds of the weights' bytes again in memory). Rejected: inductor's
  `freezing`, which packs its own copy of every weight and whose packed
  constants its disk cache cannot store (every start compiled again: 90-105 s
  for the bundled model here);
- attention (`pagedkv::decode_attention`): the ragged batch's
  (`model.batch.ragged_attention`), which writes each row's keys and values into
  its sequence's buffer and attends with the grouped decode attention.
So the graph's shapes depend on its number of rows only, never on a context
length or a buffer, and the rows are a size dynamo leaves symbolic and does not
specialize at 1 (`mark_unbacked`): one graph for every row count, compiled at
start-up and counted (`CompiledDecode.compiles`, which also counts, and logs,
any later recompile). Rejected: a graph per padded row bucket (1, 2, 4, 8, 16),
five compiles with padding rows computed for nothing; and `dynamic=True` alone,
which specializes one row and so compiles twice (each compile, and each load
from the disk cache, costs its dynamo trace: ~13 s for the bundled model here).

Which steps: those whose every chunk is one decode row with no LoRA adapter, in
the default batching mode. A step with a prompt chunk runs eagerly; so does
every step in deterministic mode, where a row must round alike whatever else
runs. A compiled row rounds otherwise than an eager one (fused element-wise
work), so the compiled step is part of the namespace's `mode`
(`ModelAdapter.identity`): KV decoded one way is never restored into a run that
decodes the other way. Cached == fresh holds within the mode: a prompt's rows
are computed eagerly either way, and decode rows are decode rows whether their
prompt was cached or not.

Start-up: the compile runs on the worker thread before the first request, each
graph's time logged. Inductor keeps what it compiled on disk (its FX graph
cache under `TORCHINDUCTOR_CACHE_DIR`, which `pagedkv/__init__.py` points at the
user cache's `inductor/` unless it is set), so a restart with the same model,
dtype and torch loads it instead of compiling again.

Fallback: a model this step does not describe (`compile_reason`), a compile
that fails (no C++ compiler, an op inductor cannot lower) or a compiled step
whose logits disagree with the eager forward's leaves the step eager, with the
reason logged and kept (`CompiledDecode.reason`): never a failed start.
"""

from __future__ import annotations

import logging
import threading
import time
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.model.batch import RaggedPlan, SeqChunk, plan_batch, ragged_attention
from pagedkv.model.linear import INT8_KERNEL, pack_linear

log = logging.getLogger(__name__)

# The row counts run at start-up: the first compiles the one graph, the second checks
# that another count needs no other.
COMPILED_ROWS = (1, 2)
# Model types whose decoder `DecodeStep` computes, layer for layer.
_PLAIN_DECODERS = ("llama", "mistral", "qwen2", "qwen3")
# Bumped when `DecodeStep` computes otherwise (part of the namespace's `mode`).
_STEP_VERSION = 1

# The plan of the step being computed on this thread: the attention op reads it (each
# engine's worker thread computes its own steps).
_running = threading.local()


# The linear layers compiled steps call (`pagedkv::linear`), by index, so the graph
# holds no weights: the model's own modules (oneDNN-packed or plain) and the fused
# copies its `DecodeStep` holds. Weak references: a step's indices are constants of its
# graph, and a model let go takes its layers with it.
_linears: list[weakref.ref[torch.nn.Module]] = []
_linear_out: list[int] = []


def _register(module: torch.nn.Module) -> int:
    _linears.append(weakref.ref(module))
    _linear_out.append(int(typing.cast(torch.nn.Linear, module).out_features))
    return len(_linears) - 1


@torch.library.custom_op("pagedkv::linear", mutates_args=())
def linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """`x [rows, in]` through the registered linear layer `index` (`_register`)."""
    module = _linears[index]()
    assert module is not None, "a compiled step outlived its model"
    return typing.cast(torch.Tensor, module(x))


@linear.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], _linear_out[index]))


class _Layer:
    """What `ragged_attention` reads of an attention module: its layer index."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


@torch.library.custom_op("pagedkv::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """Rows `q [B, heads, head_dim]`, `k` and `v` `[B, kv_heads, head_dim]`, one per decode
    chunk of the running plan: each row's keys and values go into its sequence's
    buffer, and its attention output comes back `[B, heads * head_dim]`."""
    plan: RaggedPlan = _running.plan
    n = plan.num_rows
    query = q.transpose(0, 1).unsqueeze(0)
    key = k.transpose(0, 1).unsqueeze(0)
    value = v.transpose(0, 1).unsqueeze(0)
    out, _ = ragged_attention(
        _Layer(layer),  # type: ignore[arg-type]
        query,
        key,
        value,
        None,
        scaling=scale,
        pagedkv_plan=plan,
    )
    return out[0].reshape(n, -1)


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
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


def _fused(*layers: Any) -> torch.nn.Module:
    """One linear layer computing `layers`' outputs side by side (q, k and v; gate and
    up): one product instead of two or three, each a call with a fixed cost. Packed for
    oneDNN as the model's own are (`model.linear`)."""
    weights = [layer.weight for layer in layers]
    packed = any(w.is_mkldnn for w in weights)
    dense = torch.cat([w.to_dense() if w.is_mkldnn else w.detach() for w in weights])
    biases = [layer.bias for layer in layers]
    fused = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=biases[0] is not None)
    fused.requires_grad_(False)
    fused.weight.data = dense
    if fused.bias is not None:
        fused.bias.data = torch.cat([b.detach() for b in biases])
    if packed:
        pack_linear(fused)
    return fused


class _DecodeLayer(torch.nn.Module):
    """One decoder layer's weights as the step reads them: its linear layers by index
    (`_register`; q, k and v fused, gate and up fused: copies, the rest the model's own
    modules), its norms' weights (the model's own tensors)."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        a, mlp = layer.self_attn, layer.mlp
        # The fused copies live here (the registry holds weak references).
        self.fused = torch.nn.ModuleList(
            [_fused(a.q_proj, a.k_proj, a.v_proj), _fused(mlp.gate_proj, mlp.up_proj)]
        )
        self.qkv, self.gate_up = (_register(m) for m in self.fused)
        self.qkv_sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        self.intermediate = int(mlp.up_proj.out_features)
        self.o, self.down = _register(a.o_proj), _register(mlp.down_proj)
        self.norm1 = layer.input_layernorm.weight
        self.norm2 = layer.post_attention_layernorm.weight
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.q_norm = None if q_norm is None else q_norm.weight
        self.k_norm = None if k_norm is None else k_norm.weight
        self.scale = float(a.scaling)


class DecodeStep(torch.nn.Module):
    """One decode row per sequence: `forward(ids [B], positions [B])` gives the float32
    logits `[B, vocab]`, each row's keys and values written by the attention op. It
    holds the model's own tensors (the embedding, norms, rotary table) and calls the
    model's own linear layers (`pagedkv::linear`): nothing is copied."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        text = model.config.get_text_config(decoder=True)
        inner = model.model
        self.heads = int(text.num_attention_heads)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.heads)
        self.eps = float(text.rms_norm_eps)
        self.embed = inner.embed_tokens.weight
        self.layers = torch.nn.ModuleList(_DecodeLayer(layer) for layer in inner.layers)
        self.norm = inner.norm.weight
        self.head = _register(model.lm_head)
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, hd = ids.shape[0], self.head_dim
        h = F.embedding(ids, self.embed)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos = (emb.cos() * self.rope_scale).to(h.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scale).to(h.dtype)[:, None, :]
        lin = torch.ops.pagedkv.linear
        for i, layer in enumerate(typing.cast(list[_DecodeLayer], self.layers)):
            x = self._rms(h, layer.norm1)
            q, k, v = lin(x, layer.qkv).split(layer.qkv_sizes, -1)
            q, k, v = q.view(b, -1, hd), k.view(b, -1, hd), v.view(b, -1, hd)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._rms(q, layer.q_norm), self._rms(k, layer.k_norm)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            o = torch.ops.pagedkv.decode_attention(q, k, v, i, layer.scale)
            h = h + lin(o, layer.o)
            x = self._rms(h, layer.norm2)
            gate, up = lin(x, layer.gate_up).split([layer.intermediate, layer.intermediate], -1)
            h = h + lin(F.silu(gate) * up, layer.down)
        return lin(self._rms(h, self.norm), self.head).float()


def is_decode_step(chunks: Sequence[SeqChunk]) -> bool:
    """Whether every chunk is one decode row the compiled step computes."""
    return all(
        not c.is_prompt and c.lora is None and not c.images and c.positions is None for c in chunks
    )


class CompiledDecode:
    """The decode step compiled once for any number of rows; `reason` says why it is
    not in use (None: it is)."""

    def __init__(self, model: Any) -> None:
        self.reason: str | None = None
        self.compiles = 0  # graphs compiled (or loaded from inductor's disk cache)
        self.compile_seconds: dict[int, float] = {}  # by the row count compiled for
        self.steps = 0  # decode steps computed compiled
        self._step = DecodeStep(model).eval()
        self._fn: Any = None

    @property
    def active(self) -> bool:
        return self._fn is not None and self.reason is None

    def signature(self) -> str:
        """What the namespace's `mode` names: the compiler, its version, the step's."""
        return f"inductor:torch-{torch.__version__}:v{_STEP_VERSION}"

    def compile(
        self,
        new_buffer: Callable[[int], torch.Tensor],
        kv_format: Any,
        device: torch.device,
        check: Callable[[CompiledDecode], str | None],
    ) -> None:
        """Compile the step for `COMPILED_ROWS`, each over throwaway buffers from
        `new_buffer(capacity)`, then `check(self)`: why the compiled step disagrees with
        the eager forward, or None. On any failure the step stays eager (`reason`)."""
        try:
            self._fn = torch.compile(self._step, dynamic=True, fullgraph=True)
            for rows in COMPILED_ROWS:
                started = time.perf_counter()
                chunks = [SeqChunk(new_buffer(4), 1, [0], True) for _ in range(rows)]
                self(chunks, kv_format, device)
                self.compile_seconds[rows] = seconds = time.perf_counter() - started
                log.info(
                    "decode step: %d row(s) in %.1f s, %d graph(s) compiled or loaded",
                    rows, seconds, self.compiles,
                )  # fmt: skip
            self.reason = check(self)
        except Exception as exc:  # any compiler failure: stay eager
            self.reason = f"compiling failed ({type(exc).__name__}: {exc})"
        if self.reason is not None:
            log.warning("the decode step stays eager: %s", self.reason)
            self._fn = None

    def __call__(
        self, chunks: list[SeqChunk], kv_format: Any, device: torch.device
    ) -> torch.Tensor:
        """The float32 logits `[wanted, vocab]` of one decode step (`is_decode_step`)."""
        plan, ids, positions, keep = plan_batch(chunks, None, device, kv_format, True)
        ids, positions = ids[0], positions[0]
        # The rows as a size dynamo neither fixes nor specializes at 1: one graph for all.
        torch._dynamo.decorators.mark_unbacked(ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        graphs = _graphs()
        _running.plan = plan
        try:
            with torch.inference_mode():
                logits = self._fn(ids, positions)
        finally:
            _running.plan = None
        if (new := _graphs() - graphs) > 0:
            self.compiles += new
            if len(self.compile_seconds) == len(COMPILED_ROWS):
                log.warning("the decode step compiled again, for %d rows", len(chunks))
        self.steps += 1
        return logits[keep]


def _graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
