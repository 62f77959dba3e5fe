"""What the Redis tier checks about the server it is given: authentication, the
eviction policy, and whether the hashing seed it keeps is the one in use."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import redis

log = logging.getLogger(__name__)

SEED_KEY = "pagedkv:seed"


def warn_if_open(connection_kwargs: Mapping[str, Any], where: str, has_secret: bool) -> bool:
    """Warn (and return True) when neither a password nor a cache secret protects the
    cache: then anyone who can reach the server reads every prompt's token ids and
    can write KV this engine serves. A URL without a password logs in as Redis's
    passwordless default user."""
    if has_secret or connection_kwargs.get("password"):
        return False
    log.warning(
        "Redis at %s is used without a password and without a cache secret: whoever can "
        "reach it can read prompts' token ids and store KV that this engine will serve. "
        "Give Redis an ACL user with a password (redis://user:password@host:port/0), use "
        "TLS (rediss://), and set a cache secret (--cache-secret-file or "
        "PAGEDKV_CACHE_SECRET); see docs/security.md",
        where,
    )
    return True


def check_policy(client: redis.Redis, where: str) -> int | None:
    """The server's maxmemory (0: none), warning once when its policy would fill it;
    None when CONFIG cannot be read (unreachable, or forbidden on managed Redis)."""
    try:
        raw = cast("dict[Any, Any]", client.config_get("maxmemory*"))
    except (redis.RedisError, OSError):
        return None
    config = {_text(k): _text(v) for k, v in raw.items()}  # str or bytes by version
    policy = config.get("maxmemory-policy", "")
    if policy and not policy.startswith("allkeys-"):
        log.warning(
            "Redis at %s runs maxmemory-policy %s; pagedkv needs an allkeys-* policy "
            "(allkeys-lru) or the cache fills Redis and writes fail",
            where, policy,
        )  # fmt: skip
    return int(config.get("maxmemory") or 0)


class SeedWatch:
    """Compares the hashing seed an engine uses with the one Redis keeps.

    An engine that could not reach Redis at start-up picked a seed of its own;
    once Redis answers again the two may differ, and then this engine's blocks
    there are found by no other engine and it finds none of theirs. The store
    checks at start-up and after every recovery; the warning is logged once.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.in_use: bytes | None = None
        self.mismatch = False

    def check(self, client: redis.Redis) -> bool:
        """True when Redis keeps another seed than `in_use`; Redis errors propagate."""
        if self.in_use is None:
            return False
        stored = client.get(SEED_KEY)
        if not isinstance(stored, bytes) or not stored or stored == self.in_use:
            return False
        if not self.mismatch:
            log.warning(
                "Redis at %s keeps another hashing seed than this engine uses (Redis was "
                "unreachable when the engine started, or was replaced since): blocks this "
                "engine writes there are found by no other engine, and it finds none of "
                "theirs. Restart the engine while Redis is reachable to adopt the shared "
                "seed, or give every engine the same cache secret (--cache-secret-file), "
                "from which they all derive one seed.",
                self.where,
            )
        self.mismatch = True
        return True


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
