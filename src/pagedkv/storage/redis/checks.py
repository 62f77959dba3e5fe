"""What the Redis tier checks about the server it is given: authentication, the
eviction policy, a cluster used as a single server, and whether the hashing seed
it keeps is the one in use."""

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


def warn_if_cluster(client: Any, where: str, cluster: bool) -> None:
    """Warn when a plain client was pointed at a cluster node: every read of several
    blocks would then fail (CROSSSLOT) and the tier would only back off."""
    if cluster:
        return
    try:
        enabled = client.info("cluster").get("cluster_enabled")
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError):
        return
    if enabled:
        log.warning(
            "Redis at %s is a node of a Redis Cluster, used here as a single server: "
            "reads of several blocks fail across hash slots. Pass --redis-cluster "
            "(PAGEDKV_REDIS_CLUSTER=1, CacheConfig.redis_cluster=True)",
            where,
        )


def check_policy(client: Any, where: str) -> int | None:
    """The server's maxmemory (0: none; on a cluster, the sum over its primaries),
    warning once when a policy would fill it; None when CONFIG cannot be read
    (unreachable, or forbidden on managed Redis)."""
    try:
        if isinstance(client, redis.RedisCluster):
            answers = client.config_get("maxmemory*", target_nodes=redis.RedisCluster.PRIMARIES)
            raws = cast("list[dict[Any, Any]]", list(answers.values()))  # one per primary
        else:
            raws = [client.config_get("maxmemory*")]
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError):
        return None
    capacity = 0
    warned = False
    for raw in raws:
        config = {_text(k): _text(v) for k, v in raw.items()}  # str or bytes by version
        policy = config.get("maxmemory-policy", "")
        if policy and not policy.startswith("allkeys-") and not warned:
            log.warning(
                "Redis at %s runs maxmemory-policy %s; pagedkv needs an allkeys-* policy "
                "(allkeys-lru) or the cache fills Redis and writes fail",
                where, policy,
            )  # fmt: skip
            warned = True
        capacity += int(config.get("maxmemory") or 0)
    return capacity


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

    def check(self, client: Any) -> bool:
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
