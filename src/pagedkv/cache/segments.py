"""Which images were seen where: explain's evidence for `image_changed`.

An image's key is folded into the parent key of the block its placeholder tokens
start in (`hashing.BlockHasher.parent_key`), so a prompt that sends another image
at the same place misses from that block on with nothing under its parent key:
the lookup alone would call it `new`. This history keeps, for each block an image
started in, the segments that started there, under the hash the block was chained
from *before* the fold (the previous block's hash, or the root): that hash names
the whole prefix before the block, salt and earlier images included, so a lookup
under it finds only prompts that agree up to that block.

Explain then checks, never trusting the record alone, that the cache holds (or
evicted) a block under the recorded segments' fold with the caller's own tokens
there: the same tokens with another image. Only a yes/no and the index of the
caller's own image come out; the recorded keys are digests and never leave.

Bounded: `capacity` prefixes, least recently recorded out first; each keeps its
`per_prefix` newest distinct segment lists. Thread-safe (recorded on the worker,
read by explain on any thread).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pagedkv.cache.hashing import ExtraKeys, HashChain, SegmentKey
from pagedkv.cache.history import CacheHistory, common_prefix
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.tiers import LowerTiers

Segments = tuple[tuple[int, SegmentKey], ...]
DEFAULT_CAPACITY = 8192


def starting_in(extra: ExtraKeys, block: int, block_size: int) -> Segments:
    """The segments that start in block `block`, in order."""
    lo, hi = block * block_size, (block + 1) * block_size
    return tuple(s for s in extra.segments if lo <= s[0] < hi)


def unfolded_parent(chain: HashChain, root: bytes, block: int) -> bytes:
    """The hash block `block` is chained from before its segment is folded in."""
    return root if block == 0 else chain.hashes[block - 1]


class ImageHistory:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, per_prefix: int = 4) -> None:
        self.capacity = capacity
        self.per_prefix = per_prefix
        self._seen: OrderedDict[tuple[bytes, int], list[Segments]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, chain: HashChain, root: bytes, extra: ExtraKeys, block_size: int) -> None:
        """Remember the segments of each full block of `chain` that an image starts in."""
        blocks = sorted({start // block_size for start, _ in extra.segments})
        with self._lock:
            for b in blocks:
                if b > len(chain.hashes):
                    break
                key = (unfolded_parent(chain, root, b), b)
                segs = starting_in(extra, b, block_size)
                known = [s for s in self._seen.pop(key, []) if s != segs]
                self._seen[key] = [segs, *known][: self.per_prefix]
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)

    def seen(self, parent: bytes, block: int) -> Sequence[Segments]:
        """The segment lists recorded for block `block` after `parent`, newest first."""
        with self._lock:
            return list(self._seen.get((parent, block), ()))

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()

    def __len__(self) -> int:
        return len(self._seen)


def changed_image(
    pool: BlockPool,
    lower: LowerTiers,
    history: CacheHistory,
    images: ImageHistory,
    chain: HashChain,
    extra: ExtraKeys | None,
    block: int,
) -> int | None:
    """The index (in the prompt's order) of the caller's image that differs from the one
    cached at block `block` with the same tokens, or None: the miss is not an image's.

    Yes only when an image starts in `block`, another segment list was recorded there
    after the same prefix, and a block under that list's fold agrees with every one of
    the caller's tokens of `block` that it holds (live in RAM or a lower tier, or
    evicted from RAM): then the tokens are the same and only an image differs."""
    if extra is None or not extra.segments:
        return None
    bs = pool.block_size
    ours = starting_in(extra, block, bs)
    if not ours:
        return None
    parent = unfolded_parent(chain, pool.hasher.root(extra), block)
    rest = np.asarray(chain.tokens[block * bs : (block + 1) * bs], dtype=np.int32)
    if not len(rest):
        return None
    for theirs in images.seen(parent, block):
        if theirs == ours:
            continue
        key = pool.hasher.parent_key(parent, block, ExtraKeys(segments=theirs))
        if not _same_tokens(pool, lower, history, key, rest):
            continue
        j = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        first = ours[j] if j is not None else ours[min(len(ours) - 1, len(theirs))]
        return list(extra.segments).index(first)
    return None


def _same_tokens(
    pool: BlockPool, lower: LowerTiers, history: CacheHistory, key: bytes, rest: np.ndarray
) -> bool:
    children = list(pool.peek_children(key))
    for tier in lower.tiers:
        children += [m.token_ids.astype("<i4").tobytes() for m in tier.children(key)]
    for child in children:
        n = common_prefix(child, rest)
        if n > 0 and n == min(len(child) // 4, len(rest)):
            return True
    gone = history.agreement(key, rest)
    return gone is not None and gone.num_tokens == len(rest)
