"""Assembles the prefix cache for a model from a CacheConfig."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import CacheConfig, default_ram_cache_bytes, default_ssd_cache_bytes
from ..hashing import BlockHasher
from ..model import ModelAdapter
from ..pool import BlockPool
from ..storage.base import KVTier
from ..storage.ram import KVLayout, RamBlockStore
from ..storage.tiered import LowerTiers
from .prefix import PrefixCache

if TYPE_CHECKING:
    from ..storage.redis import RedisStore
    from ..storage.ssd import SSDStore

log = logging.getLogger(__name__)


def build_prefix_cache(adapter: ModelAdapter, config: CacheConfig) -> PrefixCache | None:
    """The prefix cache for `adapter`, or None when caching is off or impossible."""
    if not config.enable_prefix_caching:
        log.info("prefix caching is off (enable_prefix_caching=False)")
        return None
    if not adapter.prefix_caching_supported:
        log.warning("prefix caching is off for %s: %s", adapter.name, adapter.unsupported_reason)
        return None
    layout = KVLayout(
        adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, config.block_size, adapter.dtype
    )
    ram_bytes = config.ram_cache_bytes
    if ram_bytes is None:
        ram_bytes = default_ram_cache_bytes()
    usable = ram_bytes // layout.bytes_per_block
    if usable < 1:
        log.warning(
            "prefix caching is off: the RAM cache (%d bytes) holds less than one block "
            "(%d bytes); raise ram_cache_bytes",
            ram_bytes,
            layout.bytes_per_block,
        )
        return None
    namespace = adapter.fingerprint(config.block_size)
    tiers: list[KVTier] = []
    ssd = redis = None
    if config.ssd_cache_dir is not None:
        from ..storage.ssd import SSDStore

        directory = Path(config.ssd_cache_dir)
        capacity = config.ssd_cache_bytes or default_ssd_cache_bytes(directory)
        ssd = SSDStore(
            directory,
            capacity,
            namespace,
            namespace_quota_bytes=config.ssd_namespace_quota_bytes,
            write_buffer_bytes=config.ssd_write_buffer_bytes,
        )
        tiers.append(ssd)
    if config.redis_url:
        from ..storage.redis import RedisStore

        redis = RedisStore(config.redis_url, namespace)
        tiers.append(redis)
    seed = resolve_seed(config.hash_seed, ssd, redis)
    hasher = BlockHasher(config.block_size, namespace, config.hash_algorithm, seed)
    max_blocks = usable + 1  # block 0 is the pool's null block
    ram = RamBlockStore(layout, max_blocks, device=adapter.device)
    pool = BlockPool(
        config.block_size, max_blocks, initial_blocks=min(ram.slab_slots, max_blocks), hasher=hasher
    )
    lower = LowerTiers(tiers, (adapter.num_layers, 2, adapter.num_kv_heads, adapter.head_dim))
    log.info(
        "prefix cache: block size %d, RAM %.1f MiB (%d blocks), tiers: %s",
        config.block_size,
        usable * layout.bytes_per_block / 2**20,
        usable,
        ", ".join(["ram"] + [t.name for t in tiers]),
    )
    return PrefixCache(pool, ram, lower, namespace)


def resolve_seed(
    configured: bytes | str | None, ssd: SSDStore | None, redis: RedisStore | None
) -> bytes:
    """SPEC §2: the configured seed, else Redis's shared seed, else the SSD
    directory's seed file, else a random seed for this process."""
    if isinstance(configured, str):
        configured = configured.encode()
    seed: bytes | None = configured
    if seed is None and redis is not None:
        proposal = ssd.seed(os.urandom(16)) if ssd is not None else os.urandom(16)
        seed = redis.seed(proposal)
    if seed is None and ssd is not None:
        seed = ssd.seed(os.urandom(16))
    if seed is None:
        seed = os.urandom(16)
    if ssd is not None:
        ssd.seed_mismatch_warning(seed)
    return seed
