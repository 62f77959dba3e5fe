"""The hot tier: a paged tensor pool addressed by block id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one block's KV: `[num_layers, 2, num_kv_heads, block_size, head_dim]`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem


class RamBlockStore:
    """KV tensors for the block pool's blocks; slot = block id.

    Storage is a list of slabs, each `[num_layers, 2, kv_heads, slab_slots,
    block_size, head_dim]`, added as the block pool grows, never beyond
    `max_slots`. Putting the slot axis after the head axis makes a gather of n
    slots come out as `[L, 2, H, n, block_size, D]`, which reshapes without a
    copy into the `[H, n * block_size, D]` run the model's cache wants: restoring
    a prefix is one `index_select` per slab touched, for all layers at once.
    Reallocating one big tensor on growth was rejected: it needs twice the
    memory for the copy, at the moment memory is scarcest.
    """

    def __init__(
        self, layout: KVLayout, max_slots: int, device: torch.device | str = "cpu"
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"the RAM tier needs room for at least 1 block, got {max_slots}")
        self.layout = layout
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.slab_slots = max(1, min(max_slots, max(16, max_slots // 8)))
        self.slabs: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return len(self.slabs) * self.slab_slots

    @property
    def bytes_allocated(self) -> int:
        return self.capacity * self.layout.bytes_per_block

    def ensure_capacity(self, num_slots: int) -> None:
        """Add slabs until slots `[0, num_slots)` exist."""
        if num_slots > self.max_slots:
            raise ValueError(f"asked for {num_slots} slots, the RAM tier holds {self.max_slots}")
        lay = self.layout
        while self.capacity < num_slots:
            shape = (
                lay.num_layers,
                2,
                lay.num_kv_heads,
                self.slab_slots,
                lay.block_size,
                lay.head_dim,
            )
            self.slabs.append(torch.empty(shape, dtype=lay.dtype, device=self.device))

    def _split(self, slots: Sequence[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Group slots by slab: (slab index, positions in `slots`, offsets in the slab)."""
        ids = torch.as_tensor(slots, dtype=torch.long)
        slab_of = ids // self.slab_slots
        if len(self.slabs) == 1 or bool((slab_of == slab_of[0]).all()):
            s = int(slab_of[0]) if len(ids) else 0
            return [(s, torch.arange(len(ids)), ids - s * self.slab_slots)]
        groups = []
        for s in torch.unique(slab_of).tolist():
            pos = torch.nonzero(slab_of == s).flatten()
            groups.append((s, pos, ids[pos] - s * self.slab_slots))
        return groups

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """KV of `slots` in order: `[L, 2, H, n * block_size, D]`."""
        lay = self.layout
        shape = (lay.num_layers, 2, lay.num_kv_heads, len(slots), lay.block_size, lay.head_dim)
        out = torch.empty(shape, dtype=lay.dtype, device=self.device)
        self._gather(slots, out)
        return out.flatten(3, 4)

    def gather_into(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """Write the first `T` tokens of `slots` into `out` `[L, 2, H, T, D]`, which may
        be a strided view (the model's own cache buffers): one `index_select` per slab
        for all layers, straight into place."""
        bs = self.layout.block_size
        n_full = out.shape[3] // bs
        if n_full:
            self._gather(slots[:n_full], out[:, :, :, : n_full * bs].unflatten(3, (n_full, bs)))
        rest = out.shape[3] - n_full * bs
        if rest:
            last = slots[n_full]
            slab = self.slabs[last // self.slab_slots]
            out[:, :, :, n_full * bs :].copy_(slab[:, :, :, last % self.slab_slots, :rest])

    def _gather(self, slots: Sequence[int], out: torch.Tensor) -> None:
        """`out[:, :, :, i] = block slots[i]` for `out` `[L, 2, H, n, block_size, D]`."""
        groups = self._split(slots)
        if len(groups) == 1:
            s, _, off = groups[0]
            torch.index_select(self.slabs[s], 3, off.to(self.device), out=out)
            return
        for s, pos, off in groups:
            out.index_copy_(3, pos.to(self.device), self.slabs[s].index_select(3, off))

    def scatter(self, slots: Sequence[int], kv: torch.Tensor) -> None:
        """Write `kv` `[L, 2, H, T, D]` (T <= n * block_size, from a block boundary) into
        `slots`; a short last block is zero-padded."""
        lay = self.layout
        n = len(slots)
        if n == 0:
            return
        need = n * lay.block_size
        if kv.shape[3] != need:
            if kv.shape[3] > need or kv.shape[3] <= need - lay.block_size:
                raise ValueError(f"{kv.shape[3]} tokens do not fill {n} blocks of {lay.block_size}")
            kv = torch.nn.functional.pad(kv, (0, 0, 0, need - kv.shape[3]))
        blocks = kv.to(self.device, lay.dtype).unflatten(3, (n, lay.block_size))
        for s, pos, off in self._split(slots):
            src = blocks if len(pos) == n else blocks.index_select(3, pos.to(self.device))
            self.slabs[s].index_copy_(3, off.to(self.device), src)

    def write_blocks(self, slots: Sequence[int], kvs: Sequence[torch.Tensor]) -> None:
        """Write whole blocks from a lower tier, `kvs[i]` `[L, 2, H, n_i, D]`, into
        `slots[i]`. Copied one block at a time, straight from each block's own
        tensor: concatenating them first would copy every byte twice."""
        for slot, kv in zip(slots, kvs, strict=True):
            slab = self.slabs[slot // self.slab_slots]
            dst = slab[:, :, :, slot % self.slab_slots]
            dst[:, :, :, : kv.shape[3]].copy_(kv)

    def export(self, slots: Sequence[int], num_tokens: Sequence[int]) -> list[torch.Tensor]:
        """Private copies of blocks for the lower tiers: `[L, 2, H, num_tokens[i], D]` each."""
        if not slots:
            return []
        bs = self.layout.block_size
        kv = self.gather(slots).unflatten(3, (len(slots), bs)).movedim(3, 0).cpu()
        return [kv[i, :, :, :, :n].contiguous() for i, n in enumerate(num_tokens)]
