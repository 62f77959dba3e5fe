"""Where else a prompt's prefix is held: under another model namespace of a shared
SSD directory or Redis (`identity_changed`), or under another tenant's salt
(`other_tenant`). Read-only probes for explain (`cache.explain`).

Both work the same way: the hash chain names a prefix under one root, and the root
folds in the namespace and the tenant's salt (`cache.hashing`), so the prompt is
hashed again under the other root, up to the block that holds the missed token,
and the tiers are asked whether that one block is there (`contains`: metadata,
no KV read). A block's hash names the whole prefix up to its end, so one hit
means the other root holds the prompt past the miss.

Costs: one chain over the prompt's first blocks per other root (xxh3, microseconds
per thousand tokens) and one `contains` of one hash; at most `MAX_NAMESPACES`
namespaces and `MAX_OTHER_SALTS` salts are tried, so a directory shared by many
models or a server with many keys costs a bounded amount per explained miss.

What is reported is a fact and the tier's description of a namespace (the same
text `pagedkv cache stats` shows the operator), never another request's tokens:
the other namespace's blocks found are under the caller's own salt, so they are
the caller's own earlier prompts under another model. Which other tenant holds a
prefix is never said, only that one does, and only to the callers that may know it
(the server decides: docs/security.md, "What explain shows to whom").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.history import common_prefix
from pagedkv.cache.pool import BlockPool
from pagedkv.storage.base import KVTier
from pagedkv.storage.ssd.namespaces import NamespaceInfo

log = logging.getLogger(__name__)

MAX_NAMESPACES = 8
MAX_OTHER_SALTS = 64


@runtime_checkable
class NamespaceSource(Protocol):
    """A lower tier that can tell the other namespaces it holds and look a hash up in
    one of them (the SSD and Redis tiers)."""

    name: str
    description: NamespaceInfo | None

    def other_namespaces(self) -> Mapping[str, NamespaceInfo | None]: ...

    def contains_in(self, namespace: str, hashes: Sequence[bytes]) -> list[bool]: ...


@dataclass(frozen=True, slots=True)
class IdentityChange:
    """The prefix is stored in `tier` under another namespace: `changed` names the
    fields of its description that differ from this model's ("model", "weights",
    "dtype", "kv_dtype", "weights_kernel", "block_size"; empty when the descriptions
    agree or one is missing, as after a KV layout change), `theirs` its summary."""

    tier: str
    changed: tuple[str, ...]
    theirs: str | None


_FIELDS = ("model", "weights", "dtype", "kv_dtype", "weights_kernel", "block_size")


def _changed(ours: NamespaceInfo | None, theirs: NamespaceInfo | None) -> tuple[str, ...]:
    if ours is None or theirs is None:
        return ()
    return tuple(f for f in _FIELDS if getattr(ours, f) != getattr(theirs, f))


def _block_at(num_tokens: int, index: int, block_size: int) -> int | None:
    """The full block of a `num_tokens` prompt that holds token `index`, else the last
    full block if it ends past `index`; None when no full block reaches past it."""
    j = min(index // block_size, num_tokens // block_size - 1)
    return j if j >= 0 and (j + 1) * block_size > index else None


def identity_change(
    tiers: Sequence[KVTier],
    hasher: BlockHasher,
    extra: ExtraKeys | None,
    tokens: np.ndarray,
    index: int,
) -> IdentityChange | None:
    """Whether a lower tier holds `tokens` past token `index` under another namespace
    (same seed, same salt): the blocks a request of another model, KV dtype or
    weights kernel left there."""
    for tier in tiers:
        if not isinstance(tier, NamespaceSource):
            continue
        try:
            others = dict(tier.other_namespaces())
        except Exception:  # a failing tier tells nothing; explain goes on
            log.debug("explain: %s could not list its namespaces", tier.name, exc_info=True)
            continue
        others.pop(hasher.namespace, None)
        newest = sorted(others.items(), key=lambda kv: -(kv[1].first_seen if kv[1] else 0.0))
        for namespace, info in newest[:MAX_NAMESPACES]:
            bs = info.block_size if info is not None else hasher.block_size
            j = _block_at(len(tokens), index, bs)
            if j is None:
                continue
            other = BlockHasher(bs, namespace, hasher.algorithm, hasher.seed)
            block_hash = other.hash_blocks(tokens[: (j + 1) * bs], extra)[j]
            try:
                (present,) = tier.contains_in(namespace, [block_hash])
            except Exception:
                continue
            if present:
                summary = info.summary() if info is not None else None
                return IdentityChange(tier.name, _changed(tier.description, info), summary)
    return None


def other_tenant_holds(
    pool: BlockPool,
    tiers: Sequence[KVTier],
    tokens: np.ndarray,
    index: int,
    others: Sequence[ExtraKeys],
) -> bool:
    """Whether the prefix of `tokens` past token `index` is cached (any tier) under one
    of the `others` (other tenants' salts). Says yes or no, never which."""
    bs = pool.block_size
    j = index // bs
    head = tokens[: (j + 1) * bs]
    for extra in others[:MAX_OTHER_SALTS]:
        chain = pool.hasher.chain(head, extra)
        if j < len(chain.hashes):
            if pool.peek_full_blocks(chain) > j:
                return True
            for tier in tiers:
                try:
                    if tier.contains([chain.hashes[j]])[0]:
                        return True
                except Exception:
                    continue
            continue
        rest = tokens[j * bs : (j + 1) * bs]
        offset = index - j * bs
        if any(common_prefix(t, rest) > offset for t in pool.peek_children(chain.parent_keys[j])):
            return True
        for tier in tiers:
            try:
                kids = tier.children(chain.parent_keys[j])
            except Exception:
                continue
            if any(common_prefix(m.token_ids.astype("<i4").tobytes(), rest) > offset for m in kids):
                return True
    return False
