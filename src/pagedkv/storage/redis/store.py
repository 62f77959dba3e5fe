"""The shared KV tier: whole blocks in Redis, so several engines reuse one cache.

Keys: `pagedkv:<namespace>:v<format version>:<hash hex>` holds one block as a
frame (layout in `format.py`); the version in the key lets engines of two
versions share a Redis during a rolling upgrade without deleting each other's
values. `pagedkv:seed` holds the hashing seed shared by engines without a cache
secret (with one, the seed is derived from it and never stored).

On a Redis Cluster (`cluster=True`) the same keys spread over the shards by
their hash slots. No operation needs two keys on one shard: a block's metadata
travels inside its own value, lookups read many blocks with one MGET per slot
(pipelined per node), and the children script touches its one key. So no key
carries a hash tag, and a namespace's blocks spread evenly.

Children index (partial-tail lookup): a sorted set `<prefix>children:<parent hex>`
(`children.py`), trimmed to the newest `MAX_CHILDREN` on every write. Redis
evicts keys one by one, so a member may name a value that is gone: `children()`
checks the members' value keys with EXISTS, drops dangling members, and returns
metadata built from the member itself (no value is read); `get` verifies the
value as usual.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from pagedkv.storage.base import BlockMeta, KVBlock, KVTier, TierStats
from pagedkv.storage.redis.breaker import Breaker
from pagedkv.storage.redis.checks import (
    SEED_KEY,
    SeedWatch,
    check_policy,
    warn_if_cluster,
    warn_if_open,
)
from pagedkv.storage.redis.children import MAX_CHILDREN, add_child, child_member, parse_member
from pagedkv.storage.redis.format import MAC_FAILED, VERSION, check_frame, encode_frame
from pagedkv.storage.redis.writer import WriteQueue
from pagedkv.storage.secret import CacheSecret
from pagedkv.storage.ssd.namespaces import NamespaceInfo, description_from_json, description_json

# field: namespace, value: its writer's description (`NamespaceInfo` as JSON)
NAMESPACES_KEY = "pagedkv:namespaces"

log = logging.getLogger(__name__)

__all__ = ["MAX_CHILDREN", "SEED_KEY", "RedisStore"]

WRITE_TIMEOUT_S = 5.0
# redis-py wraps socket failures in ConnectionError/TimeoutError; OSError covers
# what slips through (TLS handshakes). Any RedisError is treated as an outage:
# AuthenticationError and a loading server must back off like a dead one. A
# cluster's own failures (no node reachable, a slot no node serves) are not
# RedisErrors.
_FAILURES: tuple[type[BaseException], ...] = (
    redis.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
)
_T = TypeVar("_T")


class RedisStore(KVTier):
    """KV blocks shared through Redis by every engine that points at it.

    Eviction is Redis's own: run the server with a `maxmemory` and
    `maxmemory-policy allkeys-lru` (the store warns once at start when it can
    read a policy that is not allkeys-*; managed Redis that forbids CONFIG is
    fine). Values, children sets and the seed key are all ordinary keys, so
    any of them may be evicted: a missing value is a miss, a dangling child is
    skipped, and the seed (without a cache secret) is re-asserted (SET NX) with
    every write batch so it stays recent and is recreated with the same value
    if it was evicted. Recency is Redis's own LRU for values; the children sets
    order members by a counter (`children.py`), never by a clock.

    With a cache secret every frame carries a MAC over its KV and metadata; a
    frame whose MAC fails is deleted and counted (`corrupt`, and
    `extra["mac_failures"]`), and the seed is never read from or written to
    Redis: it is derived from the secret.

    Invariants:
    - No call raises for Redis trouble and none waits long on it: every socket
      operation has `socket_timeout`, redis-py retries are off, and after any
      failure the tier is skipped entirely (no network attempt) until its
      backoff expires; then one call probes, and success resumes the tier.
      Skipped and failed calls answer misses; puts are dropped.
    - `get` returns only blocks whose magic, version, hash, namespace, shape
      and checksum (and MAC) verify; anything else, whatever its bytes, is
      deleted and counted `corrupt`; `get` never raises for a value.
    - `put` hands blocks to one writer thread through a queue bounded by
      `write_queue_bytes`; when full the block is dropped (`writes_dropped`)
      at once. The writer reads `block.kv` later, so callers pass tensors they
      will not modify afterwards.
    - hits/misses/bytes_read count `get` only (`contains` is a probe);
      bytes_written counts frame bytes Redis acknowledged.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        socket_timeout: float = 0.25,
        write_queue_bytes: int = 256 * 1024**2,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        secret: CacheSecret | None = None,
        cluster: bool = False,
        description: NamespaceInfo | None = None,
    ) -> None:
        if ":" in namespace:
            raise ValueError(
                f"Redis namespace {namespace!r} contains ':', which would let key spaces "
                "overlap; use the model fingerprint (hex)"
            )
        self.namespace = namespace
        self.cluster = cluster
        # Who writes this namespace, kept in the `NAMESPACES_KEY` hash with the first
        # write (explain's `identity_changed` reads the others').
        self.description = description
        self._described = description is None
        self._url = url
        self._timeouts = (socket_timeout, max(socket_timeout, WRITE_TIMEOUT_S))
        self._clients: tuple[Any, Any] | None = None
        self._connect_lock = threading.Lock()
        if not cluster:
            self._connect()  # a plain client connects on its first command, not here
        kwargs = parse_url(url)
        where = kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', 6379)}"
        self._where = ("cluster " if cluster else "") + where
        self._prefix = f"pagedkv:{namespace}:v{VERSION}:"
        self._breaker = Breaker(backoff_initial_s, backoff_max_s)
        self._stats = TierStats(name=self.name)
        self._skipped = 0
        self._mac_failures = 0
        self._stats_lock = threading.Lock()
        self._seed: bytes | None = None
        self._seed_watch = SeedWatch(self._where)
        self.secret = secret
        self.open_warning = warn_if_open(kwargs, self._where, secret is not None)
        self._writes = WriteQueue(
            write_queue_bytes,
            self._write,
            self._check_server,
            lambda n: self._count(writes_dropped=n),
        )

    # -- clients ----------------------------------------------------------

    def _connect(self) -> tuple[Any, Any]:
        """The lookup and write clients, made on first use. A cluster client reads
        the cluster's slot map when made, so it is made inside a call through the
        breaker: a cluster that is down at start-up costs misses, not the engine.
        The writer has its own connection and a longer timeout: a pipeline of large
        SETs may take Redis longer than a lookup is allowed to wait, and sharing one
        short timeout made healthy writes trip the breaker."""
        with self._connect_lock:
            if self._clients is None:
                make = redis.RedisCluster.from_url if self.cluster else redis.Redis.from_url
                lookup_s, write_s = self._timeouts
                common: dict[str, Any] = {
                    "socket_connect_timeout": lookup_s,
                    "retry": Retry(NoBackoff(), 0),
                }
                if not self.cluster:
                    common["health_check_interval"] = 0
                self._clients = (
                    make(self._url, socket_timeout=lookup_s, **common),
                    make(self._url, socket_timeout=write_s, **common),
                )
            return self._clients

    @property
    def client(self) -> Any:
        return self._connect()[0]

    @property
    def _write_client(self) -> Any:
        return self._connect()[1]

    # -- keys -------------------------------------------------------------

    def _key(self, block_hash: bytes) -> str:
        return self._prefix + block_hash.hex()

    def _children_key(self, parent_key: bytes) -> str:
        return self._prefix + "children:" + parent_key.hex()

    # -- calls through the breaker ------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for field_name, delta in deltas.items():
                if field_name == "skipped":
                    self._skipped += delta
                elif field_name == "mac_failures":
                    self._mac_failures += delta
                else:
                    setattr(self._stats, field_name, getattr(self._stats, field_name) + delta)

    def _call(self, op: Callable[[], _T]) -> tuple[bool, _T | None]:
        """Run `op` unless the tier is backing off; (False, None) on skip or failure."""
        ticket = self._breaker.admit()
        if ticket == Breaker.SKIP:
            self._count(skipped=1)
            return False, None
        try:
            result = op()
        except _FAILURES as exc:
            first = self._breaker.failures == 0
            backoff = self._breaker.failed(ticket)
            self._count(errors=1)
            if first:
                log.warning(
                    "Redis tier at %s failed (%s: %s); skipping it for %.1f s, then retrying "
                    "with backoff. Requests continue without it.",
                    self._where, type(exc).__name__, exc, backoff,
                )  # fmt: skip
            return False, None
        self._breaker.succeeded()
        if ticket == Breaker.PROBE:
            log.warning("Redis tier at %s is reachable again; resuming", self._where)
            self._recheck_seed()
        return True, result

    def _recheck_seed(self) -> None:
        if self.secret is None:
            with contextlib.suppress(*_FAILURES):  # the next recovery checks again
                self._seed_watch.check(self.client)

    # -- KVTier -------------------------------------------------------------

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        if not hashes:
            return []

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self._key(h))
            return pipe.execute()

        ok, found = self._call(op)
        return [bool(x) for x in found] if ok and found is not None else [False] * len(hashes)

    def contains_in(self, namespace: str, hashes: Sequence[bytes]) -> list[bool]:
        """`contains` for another namespace's blocks (explain's `identity_changed`)."""
        if not hashes or ":" in namespace:
            return [False] * len(hashes)
        prefix = f"pagedkv:{namespace}:v{VERSION}:"

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(prefix + h.hex())
            return pipe.execute()

        ok, found = self._call(op)
        return [bool(x) for x in found] if ok and found is not None else [False] * len(hashes)

    def other_namespaces(self) -> dict[str, NamespaceInfo | None]:
        """The other namespaces whose writers described themselves here (at most 32)."""
        ok, raw = self._call(
            lambda: cast("dict[bytes, bytes]", self.client.hgetall(NAMESPACES_KEY))
        )
        out: dict[str, NamespaceInfo | None] = {}
        for name, value in (raw or {}).items() if ok else ():
            ns = name.decode(errors="replace")
            if ns != self.namespace and ":" not in ns and len(out) < 32:
                out[ns] = description_from_json(value, ns)
        return out

    def get(self, hashes: Sequence[bytes]) -> list[KVBlock | None]:
        if not hashes:
            return []
        keys = [self._key(h) for h in hashes]
        ok, values = self._call(lambda: cast("list[bytes | None]", self._mget(keys)))
        if not ok or values is None:
            self._count(misses=len(hashes))
            return [None] * len(hashes)
        out: list[KVBlock | None] = []
        bad: list[str] = []
        problems: list[str] = []
        nbytes = 0
        for key, h, value in zip(keys, hashes, values, strict=True):
            block = None
            if isinstance(value, bytes | bytearray):
                nbytes += len(value)
                checked = check_frame(value, h, self.namespace, self.secret)
                block = checked.block
                if block is None:
                    bad.append(key)
                    problems.append(checked.problem)
            elif value is not None:  # not what MGET returns; treated as a bad value
                bad.append(key)
                problems.append(f"a {type(value).__name__}, not bytes")
            out.append(block)
        hits = sum(b is not None for b in out)
        macs = problems.count(MAC_FAILED)
        self._count(
            hits=hits,
            misses=len(out) - hits,
            bytes_read=nbytes,
            corrupt=len(bad),
            mac_failures=macs,
        )
        if bad:
            log.warning(
                "Redis tier: %d stored block(s) failed verification (%d MAC failures; "
                "first: %s); deleted",
                len(bad), macs, problems[0],
            )  # fmt: skip
            self._call(lambda: self.client.delete(*bad))
        return out

    def _mget(self, keys: list[str]) -> list[Any]:
        client = self.client
        return client.mget_nonatomic(keys) if self.cluster else client.mget(keys)

    def put(self, blocks: Sequence[KVBlock]) -> None:
        if self._breaker.is_open() or self._writes.closing:
            self._count(writes_dropped=len(blocks), skipped=1 if blocks else 0)
            return
        dropped = self._writes.put(blocks)
        if dropped:
            self._count(writes_dropped=dropped)

    def remove(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            keys = [self._key(h) for h in hashes]
            self._call(lambda: self.client.delete(*keys))

    def children(self, parent_key: bytes) -> list[BlockMeta]:
        """Metadata of live children of `parent_key`, newest first (see module doc)."""
        zkey = self._children_key(parent_key)
        ok, members = self._call(lambda: cast("list[bytes]", self.client.zrevrange(zkey, 0, -1)))
        if not ok or not members:
            return []
        metas: list[BlockMeta] = []
        kept: list[bytes] = []
        broken: list[bytes] = []
        for member in members:
            meta = parse_member(member, parent_key, self.namespace)
            if meta is None:
                broken.append(member)
                continue
            metas.append(meta)
            kept.append(member)
        live = self.contains([m.block_hash for m in metas]) if metas else []
        broken += [member for member, alive in zip(kept, live, strict=True) if not alive]
        if broken:
            self._call(lambda: self.client.zrem(zkey, *broken))
        return [meta for meta, alive in zip(metas, live, strict=True) if alive]

    def clear(self, namespace: str) -> int:
        """Unlink every key of `namespace` (block values and children sets of every
        format version), with SCAN in batches so Redis never blocks on one big
        command; other namespaces and the seed stay. Queued writes of this store's
        namespace are dropped first. Returns the number of keys removed; a Redis that
        fails midway leaves the rest to LRU."""
        if ":" in namespace or not namespace:
            raise ValueError(f"not a namespace: {namespace!r}")
        if namespace == self.namespace:
            self._writes.drop_namespace(namespace)
        pattern = f"pagedkv:{namespace}:*"

        def op() -> int:
            removed = 0
            batch: list[bytes] = []
            for key in self._write_client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    removed += int(self._write_client.unlink(*batch))
                    batch = []
            if batch:
                removed += int(self._write_client.unlink(*batch))
            return removed

        ok, removed = self._call(op)
        return int(removed or 0) if ok else 0

    def seed(self, candidate: bytes) -> bytes | None:
        """The shared hashing seed: `candidate` if no engine set one first; None if
        unreachable, and None with a cache secret, whose derived seed is never stored
        where Redis's readers could take it."""
        if self.secret is not None:
            return None

        def op() -> Any:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(SEED_KEY, candidate, nx=True)
            pipe.get(SEED_KEY)
            return pipe.execute()[1]

        ok, value = self._call(op)
        if not ok or not isinstance(value, bytes) or not value:
            return None
        self._seed = value
        return value

    def check_seed(self, seed: bytes) -> bool:
        """True (with one warning) when Redis keeps another seed than `seed`; checked
        again whenever Redis recovers from an outage (`SeedWatch`)."""
        if self.secret is not None:
            return False
        self._seed_watch.in_use = seed
        ok, mismatch = self._call(lambda: self._seed_watch.check(self.client))
        return bool(ok and mismatch)

    def stats(self) -> TierStats:
        with self._stats_lock:
            out = replace(self._stats, location=self._where, extra={})
            skipped = self._skipped
            mac_failures = self._mac_failures
        backoff = max(0.0, self._breaker.until - time.monotonic()) if self._breaker.failures else 0
        out.extra = {
            "available": not self._breaker.is_open(),
            "skipped": skipped,
            "backoff_s": round(backoff, 3),
            "consecutive_failures": self._breaker.failures,
            "queued_bytes": self._writes.queued_bytes,
            "mac_failures": mac_failures,
            "authenticated": self.secret is not None,
            "seed_mismatch": self._seed_watch.mismatch,
        }
        return out

    def flush(self, timeout: float = 10.0) -> bool:
        return self._writes.flush(timeout)

    def close(self) -> None:
        self.flush(timeout=2.0)
        self._count(writes_dropped=self._writes.close())
        with self._connect_lock:
            clients, self._clients = self._clients, None
        for client in clients or ():
            client.close()

    # -- on the writer thread -------------------------------------------------

    def _write(self, blocks: list[KVBlock]) -> None:
        batch: list[KVBlock] = []
        frames: list[bytes] = []
        for block in blocks:
            try:
                frames.append(encode_frame(block, self.secret))
                batch.append(block)
            except ValueError as exc:
                log.warning("Redis tier: block not stored: %s", exc)
                self._count(writes_dropped=1)
        if not batch:
            return

        def op() -> list[Any]:
            pipe = self._write_client.pipeline(transaction=False)
            for block, frame in zip(batch, frames, strict=True):
                meta = block.meta
                pipe.set(self._key(meta.block_hash), frame)
                add_child(pipe, self._children_key(meta.parent_key), child_member(meta))
            if self._seed is not None and self.secret is None:
                pipe.set(SEED_KEY, self._seed, nx=True)
            if not self._described and self.description is not None:
                pipe.hsetnx(NAMESPACES_KEY, self.namespace,
                            description_json(self.namespace, self.description))  # fmt: skip
            return pipe.execute(raise_on_error=False)

        ok, results = self._call(op)
        if not ok or results is None:
            self._count(writes_dropped=len(batch))
            return
        self._described = True
        written = [not isinstance(r, Exception) for r in results[0 : 2 * len(batch) : 2]]
        nbytes = sum(len(f) for f, w in zip(frames, written, strict=True) if w)
        self._count(
            blocks_written=sum(written),
            bytes_written=nbytes,
            writes_dropped=len(batch) - sum(written),
        )
        if not all(written):
            error = next(r for r in results if isinstance(r, Exception))
            refused = len(batch) - sum(written)
            log.warning("Redis tier: server refused %d write(s): %s", refused, error)

    def _check_server(self) -> None:
        try:
            client = self.client
        except _FAILURES:
            return  # a cluster not reachable yet: its first call backs off as usual
        warn_if_cluster(client, self._where, self.cluster)
        capacity = check_policy(client, self._where)
        if capacity is not None:
            with self._stats_lock:
                self._stats.capacity_bytes = capacity
