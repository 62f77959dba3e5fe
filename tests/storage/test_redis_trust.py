"""Who the Redis tier trusts: frames authenticated by a cache secret, the seed never
stored with one, a warning for an open Redis, the seed compared after an outage,
and a Redis with a password and with TLS."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from fixtures_redis import RedisServer, make_block, make_chain
from test_redis import assert_same_block, wait_until

from pagedkv.cache.builder import resolve_seed
from pagedkv.storage.base import BlockMeta, KVBlock
from pagedkv.storage.redis.format import MAGIC, VERSION, encode_frame
from pagedkv.storage.redis.store import SEED_KEY, RedisStore
from pagedkv.storage.secret import CacheSecret

pytestmark = pytest.mark.redis

NS = "0123abcd"
SECRET = CacheSecret(b"the engines' shared secret, 32 b")
OTHER = CacheSecret(b"somebody else's secret, 32 bytes")
LOGGER = "pagedkv.storage.redis"


@pytest.fixture
def open_store() -> Iterator[Callable[..., RedisStore]]:
    stores: list[RedisStore] = []

    def factory(url: str, namespace: str = NS, **kwargs: object) -> RedisStore:
        stores.append(RedisStore(url, namespace, **kwargs))  # type: ignore[arg-type]
        return stores[-1]

    yield factory
    for store in stores:
        store.close()


def header_of(frame: bytes) -> dict:
    return json.loads(frame[12 : 12 + struct.unpack_from("<I", frame, 8)[0]])


def with_header(frame: bytes, **fields: object) -> bytes:
    """`frame` with header fields replaced, padded as the encoder pads."""
    header = header_of(frame)
    rest = frame[12 + struct.unpack_from("<I", frame, 8)[0] :]
    raw = json.dumps({**header, **fields}).encode()
    raw += b" " * (-(12 + len(raw) + 4 * header["n"]) % 64)
    return struct.pack("<4sBxxxI", MAGIC, VERSION, len(raw)) + raw + rest


def test_signed_frames_round_trip(redis_url: str, open_store) -> None:
    store = open_store(redis_url, secret=SECRET)
    blocks = make_chain(NS, num_blocks=3)
    store.put(blocks)
    assert store.flush(5)
    for got, want in zip(store.get([b.meta.block_hash for b in blocks]), blocks, strict=True):
        assert_same_block(got, want)
    s = store.stats()
    assert (s.hits, s.corrupt, s.extra["mac_failures"], s.extra["authenticated"]) == (3, 0, 0, True)


def forgeries(block: KVBlock, other: KVBlock) -> dict[str, bytes]:
    """Values a writer without the secret can make for `block`'s key."""
    signed_other = encode_frame(other, SECRET)
    moved = KVBlock(
        BlockMeta(block.meta.block_hash, other.meta.parent_key, other.meta.token_ids, NS), other.kv
    )
    return {
        # a frame whose unkeyed checksum is valid: what anyone can compute
        "valid checksum, no MAC": encode_frame(block),
        "MAC of another secret": encode_frame(block, OTHER),
        # a genuine frame of another block, renamed: its checksum redone, its MAC kept
        "moved to another key": with_header(encode_frame(moved), m=header_of(signed_other)["m"]),
        "another parent key": with_header(
            encode_frame(
                KVBlock(
                    BlockMeta(block.meta.block_hash, b"q" * 16, block.meta.token_ids, NS), block.kv
                )
            ),
            m=header_of(encode_frame(block, SECRET))["m"],
        ),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "valid checksum, no MAC",
        "MAC of another secret",
        "moved to another key",
        "another parent key",
    ],
)
def test_a_forged_frame_is_rejected_deleted_and_counted(
    redis_url: str, open_store, kind: str
) -> None:
    store = open_store(redis_url, secret=SECRET)
    block, other = make_chain(NS, num_blocks=2, seed=4)
    raw = redis.Redis.from_url(redis_url)
    key = store._key(block.meta.block_hash)
    raw.set(key, forgeries(block, other)[kind])
    assert store.get([block.meta.block_hash]) == [None]
    s = store.stats()
    assert (s.corrupt, s.extra["mac_failures"]) == (1, 1)
    assert not raw.exists(key)


def test_without_a_secret_the_checksum_alone_is_trusted(redis_url: str, open_store) -> None:
    """The other side of the trust model: what a secret protects against."""
    store = open_store(redis_url)
    block = make_block(NS, b"p" * 16, np.arange(16), seed=2)
    redis.Redis.from_url(redis_url).set(store._key(block.meta.block_hash), encode_frame(block))
    assert_same_block(store.get([block.meta.block_hash])[0], block)


def test_with_a_secret_the_seed_is_never_stored(redis_url: str, open_store) -> None:
    store = open_store(redis_url, secret=SECRET)
    assert store.seed(b"candidate") is None
    assert resolve_seed(None, [store], SECRET) == SECRET.seed
    store.put(make_chain(NS, num_blocks=2))
    assert store.flush(5)
    raw = redis.Redis.from_url(redis_url)
    assert not raw.exists(SEED_KEY)
    assert not any(SECRET.seed in (raw.get(k) or b"") for k in raw.scan_iter(_type="string"))


def test_an_open_redis_warns_at_start(redis_server_factory, open_store, caplog) -> None:
    server = redis_server_factory()
    redis.Redis.from_url(server.url).acl_setuser(
        "alice", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"]
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        open_store(server.url)
        warned = [r.getMessage() for r in caplog.records if "without a password" in r.getMessage()]
        assert len(warned) == 1
        assert "rediss://" in warned[0] and "cache secret" in warned[0]
        caplog.clear()
        assert not open_store(f"redis://alice:s3cret@127.0.0.1:{server.port}/0").open_warning
        assert not open_store(server.url, secret=SECRET).open_warning
    assert not [r for r in caplog.records if "without a password" in r.getMessage()]


def back(store: RedisStore) -> bool:
    return store.contains([b"x"]) == [False] and bool(store.stats().extra["available"])


def test_a_seed_mismatch_after_an_outage_is_logged_once(
    redis_server_factory, open_store, caplog
) -> None:
    server = redis_server_factory()
    server.stop()
    store = open_store(server.url, backoff_initial_s=0.05, backoff_max_s=0.1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        seed = resolve_seed(None, [store])  # Redis is down: a seed of this process
        server.start()
        redis.Redis.from_url(server.url).set(SEED_KEY, b"the others' seed")
        assert wait_until(lambda: back(store))
        for _ in range(3):  # later outages and recoveries do not repeat it
            server.stop()
            store.contains([b"x"])
            server.start()
            redis.Redis.from_url(server.url).set(SEED_KEY, b"the others' seed")
            assert wait_until(lambda: back(store))
    warned = [r.getMessage() for r in caplog.records if "another hashing seed" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "Restart" in warned[0] and "cache secret" in warned[0]
    assert store.stats().extra["seed_mismatch"] is True
    assert seed != b"the others' seed"


def test_a_seed_that_agrees_is_not_reported(redis_url: str, open_store, caplog) -> None:
    store = open_store(redis_url)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        seed = resolve_seed(None, [store])
        assert store.check_seed(seed) is False
        assert store.check_seed(b"not it") is True
    assert store.stats().extra["seed_mismatch"] is True


def test_requirepass(redis_server_factory, open_store) -> None:
    server = redis_server_factory(extra_args=["--requirepass", "pw-123"])
    blocks = make_chain(NS, num_blocks=2)
    good = open_store(f"redis://:pw-123@127.0.0.1:{server.port}/0", secret=SECRET)
    good.put(blocks)
    assert good.flush(5) and good.stats().blocks_written == 2
    assert all(b is not None for b in good.get([b.meta.block_hash for b in blocks]))
    anonymous = open_store(server.url)
    assert anonymous.get([blocks[0].meta.block_hash]) == [None]
    assert anonymous.stats().errors == 1  # NOAUTH is an outage, never a raise


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    """A CA, and a server certificate it signs for 127.0.0.1."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=pagedkv test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=directory,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=directory,
    )
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
        cwd=directory,
    )
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=another CA",
        "-keyout",
        "other.key",
        "-out",
        "other.crt",
        cwd=directory,
    )


@pytest.fixture
def tls_server(redis_server_factory, tmp_path: Path) -> tuple[RedisServer, int, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; it makes the test's certificates")
    binary = shutil.which("redis-server")
    version = subprocess.run(
        [binary or "redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout
    make_certificates(tmp_path)
    from fixtures_redis import _free_port

    tls_port = _free_port()
    args = [
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(tmp_path / "server.crt"),
        "--tls-key-file",
        str(tmp_path / "server.key"),
        "--tls-ca-cert-file",
        str(tmp_path / "ca.crt"),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "pw-123",
    ]
    try:
        server = redis_server_factory(extra_args=args)
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server ({version.strip()}) has no TLS support: {exc}")
        raise
    return server, tls_port, tmp_path


def test_tls_with_a_password_and_a_secret(tls_server, open_store) -> None:
    _, tls_port, certs = tls_server
    url = f"rediss://:pw-123@127.0.0.1:{tls_port}/0?ssl_ca_certs={certs / 'ca.crt'}"
    store = open_store(url, secret=SECRET, socket_timeout=3.0)
    blocks = make_chain(NS, num_blocks=3)
    store.put(blocks)
    assert store.flush(10)
    for got, want in zip(store.get([b.meta.block_hash for b in blocks]), blocks, strict=True):
        assert_same_block(got, want)
    assert store.stats().errors == 0 and not store.open_warning
    # A client that does not trust the server's CA gets nothing, and no exception.
    wrong = f"rediss://:pw-123@127.0.0.1:{tls_port}/0?ssl_ca_certs={certs / 'other.crt'}"
    doubter = open_store(wrong, secret=SECRET, socket_timeout=3.0)
    assert doubter.get([blocks[0].meta.block_hash]) == [None]
    assert doubter.stats().errors == 1
    # Plain TCP on the TLS port is not Redis: an outage, not a hang or a raise.
    start = time.monotonic()
    plain = open_store(f"redis://:pw-123@127.0.0.1:{tls_port}/0", socket_timeout=0.5)
    assert plain.get([blocks[0].meta.block_hash]) == [None]
    assert time.monotonic() - start < 3.0


def test_the_acl_user_of_docs_security_is_enough(redis_server_factory, open_store) -> None:
    """The least-privilege user docs/security.md gives runs every call of the tier."""
    server = redis_server_factory()
    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    rules = next(line for line in doc.splitlines() if "ACL SETUSER pagedkv" in line)
    admin = redis.Redis.from_url(server.url)
    admin.execute_command(*rules.split()[:2], *rules.split()[2:])
    admin.execute_command("ACL", "SETUSER", "pagedkv", ">pw-123")  # the doc's is a placeholder
    admin.execute_command("ACL", "SETUSER", "default", "off")
    store = open_store(f"redis://pagedkv:pw-123@127.0.0.1:{server.port}/0", secret=SECRET)
    parent = b"P" * 16
    blocks = [make_block(NS, parent, np.arange(i + 1), seed=i) for i in range(3)]
    store.put(blocks)
    assert store.flush(5)
    assert store.contains([b.meta.block_hash for b in blocks]) == [True] * 3
    assert all(g is not None for g in store.get([b.meta.block_hash for b in blocks]))
    assert len(store.children(parent)) == 3
    assert store.clear(NS) >= 4
    s = store.stats()
    assert (s.errors, s.writes_dropped, s.blocks_written) == (0, 0, 3)
