"""One decoder layer's decode rows, as `model.compiled` compiles it.

`decode_layer` computes a plain decoder's layer (RMS norms, rotary positions, a
SiLU-gated MLP) over decode rows `h [B, hidden]`, from tensors only
(`LayerArgs`), alike in shape from layer to layer, so one compiled layer serves
them all. `DecodeStep` builds each layer's inputs from the model's own tensors
and runs the embedding, rotary angles and output layer around it. The linear
products are `Product`s: 4-bit layers' tensors, multiplied in the generated code,
or a registered layer's index (`pagedkv::linear`); attention is the opaque op
`pagedkv::decode_attention`. Why each is so: `model.compiled`'s docstring.
"""

from __future__ import annotations

import threading
import typing
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.model.batch import RaggedPlan, ragged_attention
from pagedkv.model.int4 import INT4_GROUP, Int4Linear, int4_side_by_side
from pagedkv.model.linear import Int8Linear, int8_side_by_side, pack_linear

# The plan of the step being computed on this thread: the attention op reads it (each
# engine's worker thread computes its own steps).
running = threading.local()


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
    if isinstance(module, Int8Linear):
        # Its input codes are kept by input object; generated code may hand over a
        # buffer it reused for another activation (the whole step compiled at once
        # did: logits off by ~9 on a tiny llama; not seen with one layer compiled).
        module.inputs.forget()
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
    plan: RaggedPlan = running.plan
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
    the outputs (`int4_side_by_side`, a copy); other layers registered by index,
    fused into a copy packed for oneDNN as the model's own are (`model.linear`), or
    int8 codes side by side (`int8_side_by_side`); kept alive in `keep`."""
    if all(isinstance(layer, Int4Linear) for layer in layers):
        return int4_side_by_side(layers)
    if len(layers) == 1:
        module = layers[0]
    elif all(isinstance(layer, Int8Linear) for layer in layers):
        module = int8_side_by_side(layers)
    else:
        module = _fused(*layers)
    keep.append(module)
    return (_register(module),)


def _product(x: torch.Tensor, product: Product, out_features: int) -> torch.Tensor:
    if len(product) == 1:
        return torch.ops.pagedkv.linear(x, product[0], out_features)
    weight, scales_zeros, bias = product
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales_zeros)
    return y + bias if bias.numel() else y


class LayerShape(typing.NamedTuple):
    """What every layer of one model shares: constants of the compiled layer."""

    head_dim: int
    qkv: tuple[int, int, int]  # q, k and v's widths
    hidden: int
    intermediate: int
    eps: float
    scale: float
    q_norm: bool  # qwen3's norms of q and k


class LayerArgs(typing.NamedTuple):
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
    shape: LayerShape, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a: LayerArgs
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
        self.shape = LayerShape(
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
        self.flat = [flat_inputs(args) for args in self.layers]
        self.package: Any = None  # the compiled layer (`CompiledDecode.compile`); None: eager

    def _args(self, i: int, layer: Any) -> LayerArgs:
        a, mlp, keep = layer.self_attn, layer.mlp, self.kept
        none = torch.empty(0)
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return LayerArgs(
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


def flat_inputs(args: LayerArgs) -> list[torch.Tensor]:
    return typing.cast(list[torch.Tensor], torch.utils._pytree.tree_leaves(tuple(args)))
