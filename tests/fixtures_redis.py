"""A real redis-server started by the test run on 127.0.0.1, on a free port.

`redis_server` (session) is shared by every test; `redis_url` flushes it first.
`start_redis_cluster()` starts a three-node Redis Cluster (one primary per
third of the hash slots, no replicas).
Tests that stop, pause or shrink a server start their own with `start_redis()`
or the `redis_server_factory` fixture, so the shared one stays healthy. Tests
skip only when no `redis-server` binary exists (CI installs it and sets
PAGEDKV_REQUIRE_REDIS=1, which turns that skip into a failure); a binary that
fails to start is an error, not a skip. PAGEDKV_REDIS_SERVER names the binary.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from pagedkv.storage.base import BlockMeta, KVBlock

__all__ = [
    "RedisServer",
    "form_cluster",
    "make_block",
    "make_chain",
    "redis_cluster_nodes",
    "redis_cluster_url",
    "redis_server",
    "redis_server_factory",
    "redis_url",
    "start_redis",
    "start_redis_cluster",
]

_START_TIMEOUT_S = 10.0


def redis_server_binary() -> str | None:
    return os.environ.get("PAGEDKV_REDIS_SERVER") or shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up, with a password
    except OSError:
        return False


class RedisServer:
    """One redis-server process: no persistence, allkeys-lru, optional maxmemory.

    `stop()` kills it (SIGKILL unless `graceful`), `start()` starts it again on
    the same port (an empty server: nothing is persisted), `pause()`/`resume()`
    SIGSTOP/SIGCONT it to simulate a black-holed server that accepts TCP
    connections but never answers.
    """

    def __init__(
        self,
        binary: str,
        port: int | None = None,
        maxmemory: str | None = None,
        extra_args: Sequence[str] = (),
    ):
        self.binary = binary
        self.port = port or _free_port()
        self.maxmemory = maxmemory
        self.extra_args = list(extra_args)  # e.g. --requirepass, --tls-port
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="pagedkv-redis-"))
        self.log_path = self._dir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self._dir)]
        args += ["--logfile", str(self.log_path), "--daemonize", "no"]
        args += ["--maxmemory-policy", "allkeys-lru"]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory]
        args += self.extra_args
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise RuntimeError(
                    f"redis-server did not answer PING on 127.0.0.1:{self.port} within "
                    f"{_START_TIMEOUT_S:.0f} s; its log:\n{log[-2000:]}"
                )
            time.sleep(0.02)

    def stop(self, graceful: bool = False) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        process.wait(timeout=10)

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def flushall(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            assert sock.recv(64).startswith(b"+OK")

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def _require_binary() -> str:
    binary = redis_server_binary()
    if binary is None:
        reason = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":  # set by CI: a skip would hide gaps
            pytest.fail(reason + " but PAGEDKV_REQUIRE_REDIS=1")
        pytest.skip(reason)
    return binary


@contextlib.contextmanager
def start_redis(
    port: int | None = None, maxmemory: str | None = None, extra_args: Sequence[str] = ()
) -> Iterator[RedisServer]:
    """A fresh redis-server for the duration of the block; skips the test if none is installed."""
    server = RedisServer(_require_binary(), port, maxmemory, extra_args)
    try:
        for attempt in range(3):
            try:
                server.start()
                break
            except RuntimeError:
                # Another process may have taken the free port we picked; retry elsewhere.
                if port is not None or attempt == 2:
                    raise
                server.port = _free_port()
        yield server
    finally:
        server.cleanup()


_CLUSTER_SLOTS = 16384


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (10000 higher, at most 65535) is free too."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 55536)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _command(port: int, *args: str | int) -> bytes:
    """One command in RESP over a fresh socket; the raw reply."""
    parts = [str(a).encode() for a in args]
    payload = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in parts)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        return sock.recv(65536)


@contextlib.contextmanager
def start_redis_cluster(
    ports: Sequence[int] | None = None, wait: bool = True
) -> Iterator[list[RedisServer]]:
    """Three redis-servers in cluster mode, each serving a third of the slots.

    With `wait=False` the nodes are only planned (ports chosen, nothing started):
    call `form_cluster(nodes)` later, to test a cluster that comes up after the
    engine did."""
    binary = _require_binary()
    with contextlib.ExitStack() as stack:
        ports = list(ports) if ports else [_free_cluster_port() for _ in range(3)]
        nodes = []
        for port in ports:
            node = RedisServer(
                binary,
                port,
                extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
            )
            stack.callback(node.cleanup)
            nodes.append(node)
        if wait:
            form_cluster(nodes)
        yield nodes


def form_cluster(nodes: Sequence[RedisServer]) -> None:
    """Start the nodes, give each its third of the slots, introduce them to one
    another, and wait until every node says the cluster is ok."""
    for node in nodes:
        node.start()
    for i, node in enumerate(nodes):
        first = i * _CLUSTER_SLOTS // len(nodes)
        last = (i + 1) * _CLUSTER_SLOTS // len(nodes) - 1
        assert _command(node.port, "CLUSTER", "ADDSLOTSRANGE", first, last).startswith(b"+OK")
    for node in nodes:
        for other in nodes:
            if other is not node:
                _command(node.port, "CLUSTER", "MEET", "127.0.0.1", other.port)
    deadline = time.monotonic() + 30
    while not all(b"cluster_state:ok" in _command(n.port, "CLUSTER", "INFO") for n in nodes):
        assert time.monotonic() < deadline, "the test's Redis Cluster did not form in 30 s"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with start_redis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared server's URL, emptied for this test (restarted if a test stopped it)."""
    if redis_server.process is not None:
        redis_server.resume()
    redis_server.start()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster_nodes() -> Iterator[list[RedisServer]]:
    with start_redis_cluster() as nodes:
        yield nodes


@pytest.fixture
def redis_cluster_url(redis_cluster_nodes: list[RedisServer]) -> str:
    """A URL of the shared three-node cluster (its first node), emptied for this test."""
    for node in redis_cluster_nodes:
        node.flushall()
    return redis_cluster_nodes[0].url


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """`factory(maxmemory="8mb", port=None, extra_args=())` -> a private server, stopped
    after the test."""
    with contextlib.ExitStack() as stack:

        def factory(
            maxmemory: str | None = None, port: int | None = None, extra_args: Sequence[str] = ()
        ) -> RedisServer:
            return stack.enter_context(start_redis(port, maxmemory, extra_args))

        yield factory


def make_block(
    namespace: str,
    parent_key: bytes,
    token_ids: np.ndarray,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 8,
) -> KVBlock:
    """A block with random KV and a hash over its parent and tokens (not BlockHasher's)."""
    tokens = np.asarray(token_ids, dtype=np.int32)
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, kv_heads, len(tokens), head_dim)
    kv = torch.randn(shape, generator=gen).to(dtype)
    block_hash = xxhash.xxh3_128_digest(parent_key + tokens.tobytes())
    return KVBlock(BlockMeta(block_hash, parent_key, tokens, namespace), kv)


def make_chain(
    namespace: str, num_blocks: int, *, tokens_per_block: int = 16, seed: int = 0, **kwargs: Any
) -> list[KVBlock]:
    """`num_blocks` chained full blocks, deterministic in `seed` (same in any process)."""
    rng = np.random.default_rng(seed)
    parent = b"root" * 4
    blocks = []
    for i in range(num_blocks):
        tokens = rng.integers(0, 50_000, tokens_per_block, dtype=np.int32)
        blocks.append(make_block(namespace, parent, tokens, seed=seed * 100_003 + i, **kwargs))
        parent = blocks[-1].meta.block_hash
    return blocks
