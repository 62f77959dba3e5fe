"""The Redis frame decoder is total: any bytes are a verified block or a rejection,
never an exception. Property-based (hypothesis) over raw bytes, mutated frames and
hostile headers, then the same values through a real RedisStore."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import redis
import torch
from fixtures_redis import make_block, make_chain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.storage.base import KVBlock
from pagedkv.storage.redis.format import MAGIC, VERSION, check_frame, encode_frame
from pagedkv.storage.redis.store import RedisStore
from pagedkv.storage.secret import CacheSecret

NS = "0123abcd"
BLOCK = make_block(NS, b"p" * 16, np.arange(8), seed=1)
FRAME = encode_frame(BLOCK)
SECRET = CacheSecret(b"k" * 32)
SIGNED = encode_frame(BLOCK, SECRET)
HASH = BLOCK.meta.block_hash
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same(got: KVBlock, want: KVBlock) -> bool:
    return (
        got.meta.block_hash == want.meta.block_hash
        and got.meta.parent_key == want.meta.parent_key
        and np.array_equal(got.meta.token_ids, want.meta.token_ids)
        and got.kv.dtype == want.kv.dtype
        and torch.equal(got.kv.view(torch.uint8), want.kv.contiguous().view(torch.uint8))
    )


def split(frame: bytes) -> tuple[dict, bytes]:
    header_len = struct.unpack_from("<I", frame, 8)[0]
    return json.loads(frame[12 : 12 + header_len]), frame[12 + header_len :]


def join(header: dict | str, rest: bytes, version: int = VERSION) -> bytes:
    """A frame of `header` and `rest`, padded as the encoder pads, so the KV stays
    aligned and only the header's contents decide the verdict."""
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    raw += b" " * (-(12 + len(raw) + 4 * BLOCK.meta.num_tokens) % 64)
    return struct.pack("<4sBxxxI", MAGIC, version, len(raw)) + raw + rest


def test_a_rebuilt_frame_decodes_so_the_tests_below_can_fail() -> None:
    for frame, secret in ((FRAME, None), (SIGNED, SECRET)):
        header, rest = split(frame)
        got = verdict(join(header, rest), secret)
        assert got is not None and same(got, BLOCK)


def verdict(value: bytes, secret: CacheSecret | None = None) -> KVBlock | None:
    checked = check_frame(value, HASH, NS, secret)  # must not raise, whatever `value` is
    assert (checked.block is None) == bool(checked.problem)
    return checked.block


@FUZZ
@given(st.binary(max_size=4096))
def test_any_bytes_are_a_miss(value: bytes) -> None:
    assert verdict(value) is None


@FUZZ
@given(st.binary(max_size=2048))
def test_any_bytes_after_a_valid_prefix_are_a_miss(tail: bytes) -> None:
    assert verdict(MAGIC + bytes([VERSION, 0, 0, 0]) + tail) is None


@FUZZ
@given(st.data())
def test_a_mutated_frame_is_the_original_block_or_a_miss(data: st.DataObject) -> None:
    value = bytearray(data.draw(st.sampled_from([FRAME, SIGNED])))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "overwrite"]))
        at = data.draw(st.integers(0, max(0, len(value) - 1)))
        if op == "flip" and value:
            value[at] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del value[at : at + data.draw(st.integers(1, 64))]
        elif op == "insert":
            value[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            value[at : at + 8] = data.draw(st.binary(min_size=8, max_size=8))
    for secret in (None, SECRET):
        got = verdict(bytes(value), secret)
        assert got is None or same(got, BLOCK), "a changed frame decoded as another block"


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)
FIELDS = ["h", "p", "ns", "dtype", "shape", "n", "c", "m"]


@FUZZ
@given(st.data())
def test_hostile_header_fields_are_a_miss(data: st.DataObject) -> None:
    header, rest = split(SIGNED)
    for name in data.draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4)):
        header[name] = data.draw(JSON)
    for secret in (None, SECRET):
        got = verdict(join(header, rest), secret)
        assert got is None or same(got, BLOCK)


HUGE = ["1e999", "-1e999", "1e308", "NaN", "Infinity", "-1", "4.0", "true", "18446744073709551617"]


@pytest.mark.parametrize("number", HUGE)
@pytest.mark.parametrize("field", ["n", "shape0", "shape3", "shape4"])
def test_numbers_out_of_range_are_a_miss(field: str, number: str) -> None:
    header, rest = split(FRAME)
    text = json.dumps(header)
    if field == "n":
        text = text.replace(f'"n": {header["n"]}', f'"n": {number}')
    else:
        shape = list(header["shape"])
        shape[int(field[-1])] = "X"
        text = text.replace(json.dumps(header["shape"]), json.dumps(shape).replace('"X"', number))
    assert number in text
    assert verdict(join(text, rest)) is None


@pytest.mark.parametrize(
    "header",
    ["[" * 100_000, '"just a string"', "{}", '{"dtype": "float32"}', "\xff\xfe"],
    ids=["deep nesting", "not an object", "empty", "fields missing", "not utf-8"],
)
def test_broken_headers_are_a_miss(header: str) -> None:
    assert verdict(join(header, b"\0" * 64)) is None


def test_a_dtype_pagedkv_never_stores_is_a_miss() -> None:
    header, rest = split(FRAME)
    for dtype in ["int64", "complex64", "bool", "object", "float32 "]:
        assert verdict(join({**header, "dtype": dtype}, rest)) is None


def test_a_length_that_does_not_match_the_shape_is_a_miss() -> None:
    assert verdict(FRAME + b"\0" * 4) is None
    assert verdict(FRAME[:-4]) is None
    header, rest = split(FRAME)
    header["shape"][4] *= 2  # the checksum is over the real shape, but the length is checked first
    assert verdict(join(header, rest)) is None


POISON = {
    "random bytes": lambda v: np.random.default_rng(0).bytes(len(v)),
    "truncated": lambda v: v[: len(v) * 2 // 3],
    "1e999": lambda v: v.replace(b'"n":16', b'"n":1e999', 1),
    "flipped bytes": lambda v: bytes(b ^ 0x5A if i % 97 == 3 else b for i, b in enumerate(v)),
    "huge shape": lambda v: v.replace(b'"shape":[2,', b'"shape":[1e999,', 1),
}


@pytest.mark.redis
@pytest.mark.parametrize("kind", list(POISON))
def test_a_poisoned_value_is_a_miss_deleted_and_counted(redis_url: str, kind: str) -> None:
    store = RedisStore(redis_url, NS)
    try:
        good, victim = make_chain(NS, num_blocks=2)
        store.put([good, victim])
        assert store.flush(5)
        raw = redis.Redis.from_url(redis_url)
        key = store._key(victim.meta.block_hash)
        value = raw.get(key)
        poisoned = POISON[kind](value)
        assert poisoned != value
        raw.set(key, poisoned)
        got = store.get([good.meta.block_hash, victim.meta.block_hash])
        assert got[0] is not None and same(got[0], good)
        assert got[1] is None
        assert store.stats().corrupt == 1
        assert not raw.exists(key)
    finally:
        store.close()
