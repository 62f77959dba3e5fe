"""The persistent SSD tier: one verified file per block, an SQLite index, LRU eviction."""

from pagedkv.storage.ssd.maintenance import CheckReport, DirectoryStats
from pagedkv.storage.ssd.store import SSDStore, cache_stats, check_cache, clear_cache

__all__ = ["CheckReport", "DirectoryStats", "SSDStore", "cache_stats", "check_cache", "clear_cache"]
