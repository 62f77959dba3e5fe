"""The RAM tier: the block pool's own store, a paged tensor pool addressed by block id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ALL = slice(None)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one block's KV: `[num_layers, 2, num_kv_heads, block_size, head_dim]`,
    `num_layers` counting the layers that keep per-token KV.

    `windows[i]` is KV layer i's sliding window in tokens (None: full attention;
    empty: every layer is full): a restore copies a sliding layer's last window
    only. `state_numel` is the size of one recurrent-state snapshot (float32
    values; 0: the model has no recurrent layers), kept beside the block that
    ends where it was taken.

    `head_dim` and `dtype` are those of a stored row, which for 8-bit KV is bytes: the
    values and their scale (the engine hands them over from `model.kv_format`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    windows: tuple[int | None, ...] = ()
    state_numel: int = 0

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


class RamBlockStore:
    """KV tensors of the block pool's blocks, at the position of their block id.

    This is not a `KVTier`: the pool decides what each block holds and when it
    goes (its hash map, references and LRU order), and this store only keeps
    the tensors of block `block_id`. The lower tiers, addressed by hash, sit
    behind it.

    Storage is a list of slabs, each `[num_layers, 2, kv_heads, slab_blocks,
    block_size, head_dim]`, added as the block pool grows, never beyond
    `max_blocks`. Putting the block axis after the head axis makes a gather of
    n blocks come out as `[L, 2, H, n, block_size, D]`, which reshapes without
    a copy into the `[H, n * block_size, D]` run the model's cache wants:
    restoring a prefix is one `index_select` per slab touched, for all layers
    at once. Reallocating one big tensor on growth was rejected: it needs twice
    the memory for the copy, at the moment memory is scarcest.
    """

    def __init__(
        self, layout: KVLayout, max_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"the RAM tier needs room for at least 1 block, got {max_blocks}")
        self.layout = layout
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.slab_blocks = max(1, min(max_blocks, max(16, max_blocks // 8)))
        self.slabs: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        """Blocks the allocated slabs hold."""
        return len(self.slabs) * self.slab_blocks

    @property
    def bytes_allocated(self) -> int:
        return self.capacity * self.layout.bytes_per_block

    def ensure_capacity(self, num_blocks: int) -> None:
        """Add slabs until blocks `[0, num_blocks)` exist."""
        if num_blocks > self.max_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, the RAM tier holds {self.max_blocks}")
        lay = self.layout
        while self.capacity < num_blocks:
            shape = (
                lay.num_layers,
                2,
                lay.num_kv_heads,
                self.slab_blocks,
                lay.block_size,
                lay.head_dim,
            )
            self.slabs.append(torch.empty(shape, dtype=lay.dtype, device=self.device))

    def _split(self, block_ids: Sequence[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Group block ids by slab: (slab index, positions in `block_ids`, offsets in the slab)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        slab_of = ids // self.slab_blocks
        if len(self.slabs) == 1 or bool((slab_of == slab_of[0]).all()):
            s = int(slab_of[0]) if len(ids) else 0
            return [(s, torch.arange(len(ids)), ids - s * self.slab_blocks)]
        groups = []
        for s in torch.unique(slab_of).tolist():
            pos = torch.nonzero(slab_of == s).flatten()
            groups.append((s, pos, ids[pos] - s * self.slab_blocks))
        return groups

    def _block(self, block_id: int, layers: slice = _ALL) -> torch.Tensor:
        """One block's KV in place, `[L, 2, H, block_size, D]`."""
        slab = self.slabs[block_id // self.slab_blocks]
        return slab[layers, :, :, block_id % self.slab_blocks]

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """KV of `block_ids` in order: `[L, 2, H, n * block_size, D]`."""
        lay = self.layout
        shape = (lay.num_layers, 2, lay.num_kv_heads, len(block_ids), lay.block_size, lay.head_dim)
        out = torch.empty(shape, dtype=lay.dtype, device=self.device)
        self._gather(block_ids, out)
        return out.flatten(3, 4)

    def gather_into(
        self, block_ids: Sequence[int], out: torch.Tensor, layers: slice = _ALL
    ) -> None:
        """Write the first `T` tokens of `block_ids` into `out` `[L, 2, H, T, D]`, which
        may be a strided view (the model's own cache buffers): one `index_select` per
        slab for all layers, straight into place. `layers` picks a run of the layers
        (`out` then holds only those)."""
        bs = self.layout.block_size
        n_full = out.shape[3] // bs
        if n_full:
            self._gather(
                block_ids[:n_full], out[:, :, :, : n_full * bs].unflatten(3, (n_full, bs)), layers
            )
        rest = out.shape[3] - n_full * bs
        if rest:
            out[:, :, :, n_full * bs :].copy_(
                self._block(block_ids[n_full], layers)[:, :, :, :rest]
            )

    def _gather(self, block_ids: Sequence[int], out: torch.Tensor, layers: slice = _ALL) -> None:
        """`out[:, :, :, i] = block block_ids[i]` for `out` `[L, 2, H, n, block_size, D]`."""
        groups = self._split(block_ids)
        if len(groups) == 1:
            s, _, off = groups[0]
            torch.index_select(self.slabs[s][layers], 3, off.to(self.device), out=out)
            return
        for s, pos, off in groups:
            out.index_copy_(3, pos.to(self.device), self.slabs[s][layers].index_select(3, off))

    def scatter(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Write `kv` `[L, 2, H, T, D]` (T <= n * block_size, from a block boundary) into
        `block_ids`; a short last block is zero-padded."""
        lay = self.layout
        n = len(block_ids)
        if n == 0:
            return
        need = n * lay.block_size
        if kv.shape[3] != need:
            if kv.shape[3] > need or kv.shape[3] <= need - lay.block_size:
                raise ValueError(f"{kv.shape[3]} tokens do not fill {n} blocks of {lay.block_size}")
            kv = torch.nn.functional.pad(kv, (0, 0, 0, need - kv.shape[3]))
        blocks = kv.to(self.device, lay.dtype).unflatten(3, (n, lay.block_size))
        for s, pos, off in self._split(block_ids):
            src = blocks if len(pos) == n else blocks.index_select(3, pos.to(self.device))
            self.slabs[s].index_copy_(3, off.to(self.device), src)

    def write_blocks(self, block_ids: Sequence[int], kvs: Sequence[torch.Tensor]) -> None:
        """Write whole blocks from a lower tier, `kvs[i]` `[L, 2, H, n_i, D]`, into
        `block_ids[i]`. Copied one block at a time, straight from each block's own
        tensor: concatenating them first would copy every byte twice."""
        for block_id, kv in zip(block_ids, kvs, strict=True):
            self._block(block_id)[:, :, :, : kv.shape[3]].copy_(kv)

    def export(self, block_ids: Sequence[int], num_tokens: Sequence[int]) -> list[torch.Tensor]:
        """Private copies of blocks for the lower tiers: `[L, 2, H, num_tokens[i], D]` each."""
        if not block_ids:
            return []
        bs = self.layout.block_size
        kv = self.gather(block_ids).unflatten(3, (len(block_ids), bs)).movedim(3, 0).cpu()
        return [kv[i, :, :, :, :n].contiguous() for i, n in enumerate(num_tokens)]
