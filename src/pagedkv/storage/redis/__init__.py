"""The shared Redis tier: blocks as verified frames that several engines reuse."""

from pagedkv.storage.redis.store import RedisStore

__all__ = ["RedisStore"]
