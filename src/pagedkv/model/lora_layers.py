"""LoRA products added to the base model's linear layers, per row group of a batch.

One batch holds rows of many requests, each for the base model or an adapter.
Every adapted linear layer gets a forward hook (installed once per layer, the
first time an adapter targets it); a forward sets the step's `LoraGroup`s (for
each adapter in the step, the rows that use it) and each hook adds, for each
group, `scale * B (A x)` over that group's rows to the base layer's output.
With no group set the hooks return at once: base-only steps cost a Python call
per adapted layer.

The model adapter orders a step's chunks so that each adapter's rows are one run
(`adapter_order`), so a group is one slice: per layer and adapter, two small
products and one in-place add, no gather or scatter (index_select/index_add_
measured 10-17 ms a call on a loaded 2-core host, where the whole step took 2 s).
Layers that read one input (q, k, v; gate, up) share one A product per group: their
A matrices are stacked and each B zero-padded to the stacked rank (`PreparedLora`),
and the first sibling's `A x` is kept for the next (`LoraLayers._mid`).
Grouping was chosen over batched products over all rows at once (every adapter's
A stacked, each row masked to its own columns, then the stacked B: two products
a layer whatever the number of adapters), which make a row's sums depend on
which other adapters share the step, so an answer in a batch could differ from
the same answer alone (docs/benchmarks.md, "LoRA adapters").

Exactness: a row's delta must not depend on what else runs, or an adapter's
answer in a batch would differ from its answer alone. Over oneDNN-packed layers
(`model/linear.py`) A and B are packed too, and those products round alike for
every row count but one, so a one-row group is computed as two (the row twice).
Other layers use `F.linear` (MKL, whose rows may round otherwise at a few small
counts; same as the base layers there).

`prepare` copies the adapter's matrices to the model's dtype and device (with
`scale` folded into B), packs them and runs them once per small row count (so
oneDNN has compiled their kernels); the engine runs it on a thread of its own
that then ends (docs/architecture.md, "One thread computes"). Only `install`, a
dictionary update and a hook per newly adapted layer, runs on the worker, between
two steps (the pause is measured in `benchmarks/bench_lora.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.model.linear import PackedLinear
from pagedkv.model.lora import LoraWeights

_PACK_FOR_ROWS = 8
_WARM_ROWS = 16
_WARMED: set[tuple[torch.dtype, int, int, int]] = set()


@dataclass(frozen=True, slots=True)
class LoraGroup:
    """Rows of the flattened batch `[first, last)` ranges, all for one adapter: `rows`
    is a slice when they are one run, else an index tensor."""

    lora: LoraWeights
    rows: slice | torch.Tensor
    num_rows: int


# Layers that read one input in the usual architectures (Llama, Qwen, Mistral, ...): an
# adapter's A matrices of siblings are stacked into one product, each sibling's B padded
# with zeros to the stacked rank, so q, k and v cost one A product instead of three.
_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True, slots=True)
class LoraProduct:
    """One layer's products: `A` (stacked with its siblings' when `shared` names their
    set) and `B * scale` (zero-padded to the stacked rank), packed for oneDNN or not."""

    a: torch.Tensor
    b: torch.Tensor
    packed: bool
    shared: str | None = None


class PreparedLora:
    """An adapter's matrices as its layers multiply them: per layer a `LoraProduct`,
    packed for oneDNN where the base layer is. Made by `LoraLayers.prepare` on any
    thread; installing it is a dictionary update.

    Exactness holds as for the unstacked products: each layer's shapes are fixed per
    adapter, whatever else shares the step, and the packed products round a row alike
    at every row count but one (`_add_delta`)."""

    def __init__(self, lora: LoraWeights, layers: dict[str, torch.nn.Linear]) -> None:
        self.lora = lora
        self.products: dict[str, LoraProduct] = {}
        plain: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path, (a, b) in lora.modules.items():
            weight = layers[path].weight
            # coded weights: their activations' dtype (int4's scales hold it; int8's is float32)
            zeros = getattr(layers[path], "scales_zeros", None)
            dtype = weight.dtype if weight.is_floating_point() else torch.float32
            if zeros is not None:
                dtype = zeros.dtype
            a = a.to(device=weight.device, dtype=torch.float32)
            b = b.to(device=weight.device, dtype=torch.float32) * lora.scale
            plain[path] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        for members in _sibling_sets(plain, layers):
            stacked = torch.cat([plain[m][0] for m in members])
            packed = all(isinstance(layers[m], PackedLinear) for m in members)
            a = self._pack(stacked, packed)
            rank = plain[members[0]][0].shape[0]
            for i, member in enumerate(members):
                b = plain.pop(member)[1]
                padded = b.new_zeros(b.shape[0], stacked.shape[0])
                padded[:, i * rank : (i + 1) * rank] = b
                self.products[member] = LoraProduct(
                    a, self._pack(padded, packed), packed, shared=members[0]
                )
                if packed:
                    _warm(a, self.products[member].b, stacked.shape[0], stacked.shape[1])
        for path, (a, b) in plain.items():
            packed = isinstance(layers[path], PackedLinear)
            self.products[path] = LoraProduct(self._pack(a, packed), self._pack(b, packed), packed)
            if packed:
                _warm(self.products[path].a, self.products[path].b, lora.rank, a.shape[1])

    @staticmethod
    def _pack(weight: torch.Tensor, packed: bool) -> torch.Tensor:
        if not packed:
            return weight
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)


def _sibling_sets(
    plain: dict[str, tuple[torch.Tensor, torch.Tensor]], layers: dict[str, torch.nn.Linear]
) -> list[tuple[str, ...]]:
    """Sets of two or more adapted sibling layers (`_SIBLINGS`) under one parent, with
    the same dtype and in-features, in `_SIBLINGS`' order."""
    sets = []
    for names in _SIBLINGS:
        parents: dict[str, list[str]] = {}
        for path in plain:
            parent, _, name = path.rpartition(".")
            if name in names:
                parents.setdefault(parent, []).append(path)
        for members in parents.values():
            members.sort(key=lambda p: names.index(p.rpartition(".")[2]))
            kinds = {(plain[m][0].dtype, plain[m][0].shape[1], type(layers[m])) for m in members}
            if len(members) > 1 and len(kinds) == 1:
                sets.append(tuple(members))
    return sets


def _warm(a: torch.Tensor, b: torch.Tensor, rank: int, in_features: int) -> None:
    """Run the packed products once per small row count: oneDNN compiles a kernel per
    shape on first use (~1 ms each, measured), and its cache is shared by every thread,
    so the worker's steps find them made. Once per shape in the process: a layer of
    the same shape (q and o; k and v) finds them made too."""
    shape = (a.dtype, in_features, rank, b.shape[0] if b.dim() == 2 else -1)
    if shape in _WARMED:
        return
    _WARMED.add(shape)
    for rows in range(2, _WARM_ROWS + 1):
        x = torch.zeros(rows, in_features, dtype=a.dtype)
        mid = torch.ops.mkldnn._linear_pointwise(x, a, None, "none", [], "")
        torch.ops.mkldnn._linear_pointwise(mid, b, None, "none", [], "")


class LoraLayers:
    """The adapters installed in one model and the hooks that apply them. `prepare`
    may run on any thread; `install`, `remove` and `route` on the worker thread only
    (as the model adapter), between or around forwards, never during one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._linears = {p: m for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self._hooked: set[str] = set()
        self._prepared: dict[int, PreparedLora] = {}  # id(LoraWeights) -> its products
        self._groups: Sequence[LoraGroup] = ()
        # The last shared A product per group: (the input object, its sibling set, mid).
        # Siblings called one after another on one input reuse it; anything else misses.
        self._mids: dict[int, tuple[Any, str, torch.Tensor]] = {}

    def prepare(self, lora: LoraWeights) -> PreparedLora:
        """`lora`'s products in the model's dtype, packed where its layers are."""
        return PreparedLora(lora, self._linears)

    def install(self, prepared: PreparedLora) -> None:
        """Serve `prepared`'s adapter: keep its products and hook the layers it adapts."""
        self._prepared[id(prepared.lora)] = prepared
        for path in prepared.products:
            if path not in self._hooked:
                self._linears[path].register_forward_hook(self._hook(path))
                self._hooked.add(path)

    def remove(self, lora: LoraWeights) -> None:
        """Forget `lora`'s products (its hooks stay: they cost nothing without groups)."""
        self._prepared.pop(id(lora), None)

    def installed(self, lora: LoraWeights) -> bool:
        return id(lora) in self._prepared

    @contextlib.contextmanager
    def route(self, groups: Sequence[LoraGroup]) -> Iterator[None]:
        """Apply `groups` to the forwards run inside."""
        for group in groups:
            if id(group.lora) not in self._prepared:
                raise RuntimeError(f"adapter {group.lora.name!r} is not installed")
        self._groups = groups
        try:
            yield
        finally:
            self._groups = ()
            self._mids.clear()

    def _hook(self, path: str) -> Any:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
            if not self._groups:
                return None
            x = inputs[0]
            flat_x = x.reshape(-1, x.shape[-1])
            flat_y = output.view(-1, output.shape[-1])
            for group in self._groups:
                product = self._prepared[id(group.lora)].products.get(path)
                if product is not None:
                    _add_delta(flat_x, flat_y, group, product, self._mid(x, group, product))
            return output

        return hook

    def _mid(
        self, x: Any, group: LoraGroup, product: LoraProduct
    ) -> Callable[[Callable[[], torch.Tensor]], torch.Tensor]:
        """`A x` for `group`'s rows: for a sibling, the product its set already computed on
        this very input, else computed (and kept for the next sibling)."""

        def get(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
            if product.shared is None:
                return compute()
            last = self._mids.get(id(group))
            if last is not None and last[0] is x and last[1] == product.shared:
                return last[2]
            mid = compute()
            self._mids[id(group)] = (x, product.shared, mid)
            return mid

        return get


def _add_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    group: LoraGroup,
    product: LoraProduct,
    mid_of: Callable[[Callable[[], torch.Tensor]], torch.Tensor],
) -> None:
    """`y[rows] += B (A x[rows])` (B holds the scale); `mid_of` gives `A x[rows]`, shared
    between siblings."""
    rows = group.rows
    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    one = xs.shape[0] == 1
    if one and product.packed:
        xs = xs.expand(2, -1)  # oneDNN rounds one row on its own; two like every other count
    if product.packed:
        mid = mid_of(
            lambda: torch.ops.mkldnn._linear_pointwise(xs, product.a, None, "none", [], "")
        )
        delta = torch.ops.mkldnn._linear_pointwise(mid, product.b, None, "none", [], "")
    else:
        delta = F.linear(mid_of(lambda: F.linear(xs, product.a)), product.b)
    if one and product.packed:
        delta = delta[:1]
    if isinstance(rows, slice):
        y[rows] += delta
    else:
        y.index_add_(0, rows, delta)


def lora_groups(
    loras: Sequence[LoraWeights | None],
    offsets: Sequence[int],
    lengths: Sequence[int],
    device: torch.device,
) -> list[LoraGroup]:
    """The groups of a batch whose chunk i (rows `offsets[i]` to `+ lengths[i]`) is for
    `loras[i]` (None: the base model)."""
    runs: dict[int, tuple[LoraWeights, list[tuple[int, int]]]] = {}
    for lora, first, n in zip(loras, offsets, lengths, strict=True):
        if lora is None:
            continue
        _, spans = runs.setdefault(id(lora), (lora, []))
        if spans and spans[-1][1] == first:
            spans[-1] = (spans[-1][0], first + n)
        else:
            spans.append((first, first + n))
    groups = []
    for lora, spans in runs.values():
        total = sum(end - start for start, end in spans)
        if len(spans) == 1:
            rows: slice | torch.Tensor = slice(spans[0][0], spans[0][1])
        else:
            rows = torch.cat([torch.arange(s, e) for s, e in spans]).to(device)
        groups.append(LoraGroup(lora, rows, total))
    return groups


def adapter_order(loras: Sequence[LoraWeights | None]) -> list[int] | None:
    """An order of a batch's chunks that puts each adapter's chunks side by side (the
    base model's first, then adapters as they first appear); None when no chunk has
    an adapter or they already are. Rows are computed alike wherever they sit in the
    batch (the linear layers are row-stable, attention is per chunk)."""
    if all(lora is None for lora in loras):
        return None
    rank: dict[int, int] = {}
    for lora in loras:
        rank.setdefault(0 if lora is None else id(lora), len(rank) + 1)
    keys = [0 if lora is None else rank[id(lora)] for lora in loras]
    if keys == sorted(keys):
        return None
    return sorted(range(len(loras)), key=keys.__getitem__)


def unpermute_wanted(order: Sequence[int], wanted: Sequence[bool]) -> list[int]:
    """For logits computed over chunks in `order` (`wanted[k]`: permuted chunk k
    returned logits), the rows that put them back in the original chunks' order."""
    original = sorted(order[k] for k, w in enumerate(wanted) if w)
    position = {chunk: i for i, chunk in enumerate(original)}
    dest = [position[order[k]] for k, w in enumerate(wanted) if w]
    rows = [0] * len(dest)
    for row, d in enumerate(dest):
        rows[d] = row
    return rows
