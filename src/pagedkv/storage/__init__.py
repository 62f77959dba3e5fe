"""Storage tiers below RAM: the tier contract, the SSD tier and the Redis tier."""

from pagedkv.storage.base import BlockMeta, KVBlock, KVTier, TierStats

__all__ = ["BlockMeta", "KVBlock", "KVTier", "TierStats"]
