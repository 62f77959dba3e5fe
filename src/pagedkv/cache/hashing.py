"""Chained content hashes that name a token prefix block by block.

Block i's hash is ``H(parent_key_i || int32-LE token bytes of block i)``, where
``parent_key_0`` is a root derived from the seed, the model namespace, the
tenant salt and the adapter, and ``parent_key_i`` is block i-1's hash, folded
with block i's multimodal segment key when one applies. A block's hash
therefore names the whole prefix up to its end, and no two kinds of extra key
can collide: every field is tagged by kind and length-prefixed.

The seed keys every digest (it is also xxh3's 64-bit seed), so outsiders who
do not know it cannot predict hashes or craft collisions; callers that need a
cache to outlive the process pass a stable seed (the cache builder reads it
from the configuration, Redis or the SSD directory).
Even so, a hash is never trusted alone: the pool verifies every hit against
the stored parent key and token ids.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

__all__ = ["ALGORITHMS", "BlockHasher", "ExtraKeys", "HashChain", "TokenIds", "pack_tokens"]

ALGORITHMS = ("xxh3_128", "sha256")
TokenIds = Sequence[int] | np.ndarray
SegmentKey = str | bytes

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _field(tag: bytes, value: str | bytes | None) -> bytes:
    """Tag plus length-prefixed value; a missing value is its own tag."""
    if value is None:
        return tag.lower()
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return tag + struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides the tokens decides a block's KV.

    ``cache_salt`` (a tenant's secret) and ``adapter`` (a LoRA adapter's digest of
    its weights and config, never its name) change the
    root, so every block of the prompt. ``segments`` are ``(start_token, key)``
    ranges, e.g. an image's digest at the position of its placeholder tokens;
    block i takes the key of the last range with ``start < (i+1)*block_size``.
    Segments are kept sorted by start (stable for equal starts).
    """

    cache_salt: str | bytes | None = None
    adapter: str | None = None
    segments: Sequence[tuple[int, SegmentKey]] = ()
    _starts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cache_salt, str | bytes | None):
            raise TypeError(f"cache_salt must be str, bytes or None, got {self.cache_salt!r}")
        if not isinstance(self.adapter, str | None):
            raise TypeError(f"adapter must be a str or None, got {self.adapter!r}")
        segments = tuple(self.segments)
        for seg in segments:
            if (
                not isinstance(seg, tuple)
                or len(seg) != 2
                or not isinstance(seg[0], int)
                or seg[0] < 0
                or not isinstance(seg[1], str | bytes)
            ):
                raise ValueError(
                    f"a segment must be (start_token >= 0, key as str or bytes), got {seg!r}"
                )
        segments = tuple(sorted(segments, key=lambda s: s[0]))
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "_starts", tuple(s[0] for s in segments))

    def segment_key(self, block_index: int, block_size: int) -> SegmentKey | None:
        """The key of the last segment starting before block ``block_index`` ends."""
        if not self._starts:
            return None
        pos = bisect.bisect_left(self._starts, (block_index + 1) * block_size)
        return self.segments[pos - 1][1] if pos else None


_NO_EXTRA = ExtraKeys()


@dataclass(frozen=True, slots=True, repr=False)
class HashChain:
    """A prompt's tokens and its hash chain.

    ``hashes[i]`` names full block i; ``parent_keys[i]`` is the key block i's
    hash was computed from, with one more entry for the block after the last
    full one (the partial tail, or the next block to be written), so
    ``len(parent_keys) == len(hashes) + 1``. ``token_bytes`` is ``tokens`` as
    int32 little-endian bytes.
    """

    tokens: np.ndarray
    hashes: list[bytes]
    parent_keys: list[bytes]
    token_bytes: bytes = b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4

    def __repr__(self) -> str:
        return f"HashChain(num_tokens={self.num_tokens}, num_hashes={len(self.hashes)})"


def _bad_token(values: Sequence[Any]) -> Exception:
    """Find the first offending token for the error message (slow path only)."""
    for i, v in enumerate(values):
        if not isinstance(v, int | np.integer):
            return TypeError(f"token ids must be ints, got {type(v).__name__} {v!r} at index {i}")
        if not _INT32_MIN <= int(v) <= _INT32_MAX:
            return ValueError(f"token id {int(v)} at index {i} is outside the int32 range")
    return TypeError("token ids must be a sequence of ints")


def pack_tokens(token_ids: TokenIds) -> bytes:
    """Token ids as int32 little-endian bytes, validated, without a per-token Python loop.

    Sequences go through one ``struct.pack``, which validates in C as it
    converts; it measured 2x faster than ``array.array('i')`` or
    ``np.fromiter`` on chat-sized prompts (5 vs 12 ns per token) and, unlike
    ``np.array(..., dtype=np.int32)``, never truncates a float silently.
    Non-int → ``TypeError``; outside int32 → ``ValueError``.
    """
    if isinstance(token_ids, bytes | bytearray | str):
        raise TypeError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    if not isinstance(token_ids, list | tuple) and hasattr(token_ids, "__array__"):
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"token ids must have an integer dtype, got {arr.dtype}")
        if arr.size and arr.dtype.itemsize >= 4 and arr.dtype != np.int32:
            low, high = int(arr.min()), int(arr.max())
            if low < _INT32_MIN or high > _INT32_MAX:
                bad = low if low < _INT32_MIN else high
                raise ValueError(f"token id {bad} is outside the int32 range")
        return arr.astype("<i4", copy=False).tobytes()
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except (struct.error, TypeError) as exc:
        values = token_ids if isinstance(token_ids, Sequence) else list(token_ids)
        raise _bad_token(values) from exc


class BlockHasher:
    """Hashes token blocks into a chain; see the module docstring for the scheme.

    Stateless after construction and safe to share between threads. Digests
    are 16 bytes (``xxh3_128``) or 32 bytes (``sha256``).
    """

    def __init__(
        self,
        block_size: int = 64,
        namespace: str = "",
        algorithm: str = "xxh3_128",
        seed: bytes | str | None = None,
    ) -> None:
        if (
            not isinstance(block_size, int)
            or isinstance(block_size, bool)
            or not 1 <= block_size <= 1024
            or (block_size & (block_size - 1))
        ):
            raise ValueError(
                f"block_size must be a power of two from 1 to 1024, got {block_size!r}"
            )
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if seed is None:
            seed = os.urandom(16)
        elif isinstance(seed, str):
            seed = seed.encode()
        elif not isinstance(seed, bytes):
            raise TypeError(f"seed must be bytes, str or None, got {type(seed).__name__}")
        self.block_size = block_size
        self.namespace = namespace
        self.algorithm = algorithm
        self.seed: bytes = seed
        self.digest_size = 16 if algorithm == "xxh3_128" else 32
        self._block_bytes = 4 * block_size
        self._seed64 = int.from_bytes(
            hashlib.sha256(b"pagedkv-seed64" + seed).digest()[:8], "little"
        )
        self._sha_base = hashlib.sha256(_field(b"K", seed))
        # Subclasses that override the per-block functions (tests do, to force
        # collisions) must see every block go through them.
        cls = type(self)
        self._inline = (
            cls.hash_block is BlockHasher.hash_block and cls.parent_key is BlockHasher.parent_key
        )

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self.block_size}, namespace={self.namespace!r}, "
            f"algorithm={self.algorithm!r})"
        )

    def _digest(self, data: bytes) -> bytes:
        if self.algorithm == "xxh3_128":
            return xxhash.xxh3_128_digest(data, self._seed64)
        h = self._sha_base.copy()
        h.update(data)
        return h.digest()

    def root(self, extra: ExtraKeys | None = None) -> bytes:
        """Parent key of block 0: H(seed, namespace, tagged salt, tagged adapter)."""
        extra = extra or _NO_EXTRA
        return self._digest(
            b"pagedkv-root\x00"
            + _field(b"K", self.seed)
            + _field(b"N", self.namespace)
            + _field(b"S", extra.cache_salt)
            + _field(b"A", extra.adapter)
        )

    def parent_key(self, parent_key: bytes, block_index: int, extra: ExtraKeys | None) -> bytes:
        """``parent_key`` folded with block ``block_index``'s segment key, if any."""
        key = extra.segment_key(block_index, self.block_size) if extra is not None else None
        if key is None:
            return parent_key
        return self._digest(b"pagedkv-segment\x00" + parent_key + _field(b"G", key))

    def hash_block(self, parent_key: bytes, token_bytes: bytes) -> bytes:
        """Hash of one block (full or partial) from its parent key and int32-LE tokens."""
        return self._digest(parent_key + token_bytes)

    def hash_blocks(self, token_ids: TokenIds, extra: ExtraKeys | None = None) -> list[bytes]:
        """One hash per full block of ``token_ids``."""
        return self._chain(pack_tokens(token_ids), extra)[0]

    def chain(self, token_ids: TokenIds, extra: ExtraKeys | None = None) -> HashChain:
        """Tokens, full-block hashes and parent keys (one more than hashes)."""
        buf = pack_tokens(token_ids)
        hashes, parent_keys = self._chain(buf, extra)
        return HashChain(np.frombuffer(buf, dtype="<i4"), hashes, parent_keys, buf)

    def extend(
        self, chain: HashChain, token_ids: TokenIds, extra: ExtraKeys | None = None
    ) -> HashChain:
        """``chain`` continued by ``token_ids``: only the blocks that were not full in
        ``chain`` are hashed. ``extra`` must be what ``chain`` was made with."""
        more = pack_tokens(token_ids)
        if not more:
            return chain
        buf = chain.token_bytes + more
        size = self._block_bytes
        hashes, parent_keys = list(chain.hashes), list(chain.parent_keys)
        for i in range(len(hashes), len(buf) // size):
            block_hash = self.hash_block(parent_keys[i], buf[i * size : (i + 1) * size])
            hashes.append(block_hash)
            parent_keys.append(self.parent_key(block_hash, i + 1, extra))
        return HashChain(np.frombuffer(buf, dtype="<i4"), hashes, parent_keys, buf)

    def _chain(self, buf: bytes, extra: ExtraKeys | None) -> tuple[list[bytes], list[bytes]]:
        size = self._block_bytes
        num_full = len(buf) // size
        parent = self.root(extra)
        hashes: list[bytes] = []
        if self._inline and (extra is None or not extra.segments):
            # The hot loop: one C call per block and no segment lookups.
            parent_keys = [parent]
            if self.algorithm == "xxh3_128":
                digest, seed64 = xxhash.xxh3_128_digest, self._seed64
                for start in range(0, num_full * size, size):
                    parent = digest(parent + buf[start : start + size], seed64)
                    hashes.append(parent)
            else:
                base = self._sha_base
                for start in range(0, num_full * size, size):
                    h = base.copy()
                    h.update(parent + buf[start : start + size])
                    parent = h.digest()
                    hashes.append(parent)
            parent_keys.extend(hashes)
            return hashes, parent_keys
        parent_keys = []
        for i in range(num_full):
            key = self.parent_key(parent, i, extra)
            parent_keys.append(key)
            parent = self.hash_block(key, buf[i * size : (i + 1) * size])
            hashes.append(parent)
        parent_keys.append(self.parent_key(parent, num_full, extra))
        return hashes, parent_keys
