"""Assembles a prefix cache from a CacheConfig: the tiers, the hashing seed, the pool."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pagedkv.cache.hashing import BlockHasher
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.ram import KVLayout, RamBlockStore
from pagedkv.cache.snapshots import SnapshotStore
from pagedkv.cache.split import WindowSplit
from pagedkv.cache.tiers import LowerTiers
from pagedkv.config import CacheConfig, default_ram_cache_bytes, default_ssd_cache_bytes
from pagedkv.storage.base import KVTier
from pagedkv.storage.secret import CacheSecret, load_secret
from pagedkv.storage.ssd.namespaces import NamespaceInfo

log = logging.getLogger(__name__)


def build_prefix_cache(
    config: CacheConfig,
    layout: KVLayout,
    namespace: str,
    device: torch.device | str = "cpu",
    description: NamespaceInfo | None = None,
) -> PrefixCache | None:
    """The prefix cache for blocks of `layout` in `namespace` (the model's fingerprint),
    or None when the RAM budget holds less than one block. `description` (the model's
    name and dtypes) is recorded in the SSD directory for `pagedkv cache stats`."""
    ram_bytes = config.ram_cache_bytes
    if ram_bytes is None:
        ram_bytes = default_ram_cache_bytes()
    state_bytes = 0
    if layout.state_numel:
        # RAM shared in proportion to what one snapshot interval stores of each.
        snapshot = 4 * layout.state_numel
        interval = config.snapshot_interval_blocks * layout.bytes_per_block
        state_bytes = ram_bytes * snapshot // (snapshot + interval)
    usable = (ram_bytes - state_bytes) // layout.bytes_per_block
    if usable < 1:
        log.warning(
            "prefix caching is off: the RAM cache (%d bytes) holds less than one block "
            "(%d bytes); raise ram_cache_bytes",
            ram_bytes,
            layout.bytes_per_block,
        )
        return None
    secret = load_secret(config.cache_secret, config.cache_secret_file)
    tiers: list[KVTier] = []
    if config.ssd_cache_dir is not None:
        from pagedkv.storage.ssd import SSDStore

        directory = Path(config.ssd_cache_dir)
        capacity = config.ssd_cache_bytes or default_ssd_cache_bytes(directory)
        tiers.append(
            SSDStore(
                directory,
                capacity,
                namespace,
                namespace_quota_bytes=config.ssd_namespace_quota_bytes,
                write_buffer_bytes=config.ssd_write_buffer_bytes,
                secret=secret,
                description=description,
            )
        )
    if config.redis_url:
        from pagedkv.storage.redis import RedisStore

        tiers.append(
            RedisStore(
                config.redis_url,
                namespace,
                secret=secret,
                cluster=config.redis_cluster,
                description=description,
            )
        )
    seed = resolve_seed(config.hash_seed, tiers, secret)
    hasher = BlockHasher(config.block_size, namespace, config.hash_algorithm, seed)
    max_blocks = usable + 1  # block 0 is the pool's null block
    ram = RamBlockStore(layout, max_blocks, device=device)
    pool = BlockPool(
        config.block_size,
        max_blocks,
        initial_blocks=min(ram.slab_blocks, max_blocks),
        hasher=hasher,
    )
    kv_shape = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    split = None
    if any(w is not None for w in layout.windows):
        split = WindowSplit(layout.windows, kv_shape)
        # the lower tiers' block entries hold the full-attention layers only
        kv_shape = (len(split.full_rows), 2, layout.num_kv_heads, layout.head_dim)
    log.info(
        "prefix cache: block size %d, RAM %.1f MiB (%d blocks), tiers: %s",
        config.block_size,
        usable * layout.bytes_per_block / 2**20,
        usable,
        ", ".join(["ram"] + [t.name for t in tiers]),
    )
    snapshots = None
    if layout.state_numel:
        snapshots = SnapshotStore(
            layout.state_numel,
            state_bytes,
            tiers,
            namespace,
            interval_tokens=config.snapshot_interval_blocks * config.block_size,
        )
        log.info(
            "recurrent-state snapshots: every %d blocks, %d bytes each, RAM %.1f MiB",
            config.snapshot_interval_blocks,
            snapshots.nbytes,
            state_bytes / 2**20,
        )
    lower = LowerTiers(tiers, kv_shape, block_size=config.block_size, dtype=layout.dtype)
    cache = PrefixCache(pool, ram, lower, namespace, snapshots, split)
    cache.set_max_leased_fraction(config.max_leased_fraction)
    return cache


def resolve_seed(
    configured: bytes | str | None, tiers: list[KVTier], secret: CacheSecret | None = None
) -> bytes:
    """The hashing seed: the configured one, else the cache secret's, else the persistent
    tiers', else a random seed for this process. A seed derived from the secret is
    never offered to a tier to keep. Each tier in turn (SSD before Redis) is offered the seed
    so far and answers with the one it keeps, creating it from the offer when it has
    none; a later tier's answer wins, so every engine on one Redis agrees, and an
    SSD directory meeting a fresh Redis hands it its own seed."""
    if isinstance(configured, str):
        configured = configured.encode()
    seed = configured
    if seed is None and secret is not None:
        seed = secret.seed
    if seed is None:
        seed = os.urandom(16)
        for tier in tiers:
            seed = tier.seed(seed) or seed
    for tier in tiers:
        tier.check_seed(seed)
    return seed
