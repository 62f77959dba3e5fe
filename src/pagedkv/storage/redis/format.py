"""The frame that holds one KV block as a Redis value.

    offset 0   4s  magic b"PKVR"
           4   B   format version (2)
           5   3x  reserved, zero
           8   <I  header length H
          12   H   JSON header {"h", "p", "ns", "dtype", "shape", "n", "c", "m"?}:
                   block hash and parent key (hex), namespace, torch dtype name, KV
                   shape, token count, block_checksum (hex), and with a cache secret
                   the MAC (hex); space-padded so the KV starts at a multiple of 64
     12 + H    4n  token ids, int32 little-endian
     then          raw KV bytes, C order, `shape` x `dtype`

A JSON header (not a fixed struct) lets later versions add fields; it costs
microseconds against milliseconds of transfer per block. Version 2 added "m";
the version is also part of the key (`store.py`), so engines of two versions
sharing a Redis keep apart instead of deleting each other's values.

The decoder is total: any bytes at all give a verified block or a rejection
naming what failed, never an exception, because the bytes come from whoever
can write to Redis. Every field is type-checked before use (a JSON number such
as `1e999` is a float, never an int; a size is computed with Python integers,
which cannot overflow).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from pagedkv.storage.base import BlockMeta, KVBlock, block_checksum
from pagedkv.storage.secret import MAC_SIZE, CacheSecret

MAGIC = b"PKVR"
VERSION = 2
_PREFIX = struct.Struct("<4sBxxxI")
_KV_ALIGN = 64
_MAX_HEADER_BYTES = 64 * 1024  # real headers are ~300 bytes; bounds json.loads' work
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,  # 8-bit KV rows with their scales (pagedkv.model.kv_format)
    )
}
# torch warns, once per process, when a tensor wraps an immutable buffer, which
# decode_frame does on purpose. Spend that one warning here, silenced, rather than
# filtering warnings globally (pytest and servers reset filters).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

MAC_FAILED = "MAC does not verify"


@dataclass(frozen=True, slots=True)
class FrameCheck:
    """What `check_frame` made of a value: the block, or why there is none."""

    block: KVBlock | None
    problem: str = ""  # "" for a verified block; MAC_FAILED, or what else is wrong


def _mac_parts(meta: BlockMeta, dtype: str, shape: tuple[int, ...], kv: Any) -> tuple[bytes, ...]:
    # Every field a reader trusts: a frame moved to another key, namespace or
    # parent, or with other tokens, dtype or shape, fails as surely as altered KV.
    # The KV enters as its SHA-256 (hash, then MAC the digest): SHA-256 runs on
    # the CPU's SHA instructions at ~1.1 GB/s here, keyed BLAKE2b over the whole
    # KV at ~0.33 GB/s, which cut restore throughput by 45%.
    tokens = np.ascontiguousarray(meta.token_ids, dtype="<i4").tobytes()
    geometry = f"{VERSION}|{dtype}|{shape}".encode()
    digest = hashlib.sha256(kv).digest()
    return (meta.namespace.encode(), meta.block_hash, meta.parent_key, tokens, geometry, digest)


def encode_frame(block: KVBlock, secret: CacheSecret | None = None) -> bytes:
    """The stored frame of `block` (layout above), with its MAC when `secret` is set.

    Raises ValueError for a dtype that `decode_frame` would reject.
    """
    kv = block.kv.detach().contiguous().cpu()
    dtype = str(kv.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"cannot store KV of dtype {kv.dtype} in Redis; use one of {[*_DTYPES]}")
    meta = block.meta
    tokens = np.ascontiguousarray(meta.token_ids, dtype="<i4")
    payload = kv.view(torch.uint8).reshape(-1).numpy().data if kv.numel() else b""
    header = {
        "h": meta.block_hash.hex(),
        "p": meta.parent_key.hex(),
        "ns": meta.namespace,
        "dtype": dtype,
        "shape": list(kv.shape),
        "n": int(tokens.shape[0]),
        "c": block_checksum(KVBlock(meta, kv)).hex(),
    }
    if secret is not None:
        header["m"] = secret.mac(*_mac_parts(meta, dtype, tuple(kv.shape), payload)).hex()
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(_PREFIX.size + len(raw) + tokens.nbytes) % _KV_ALIGN)
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(raw)), raw, tokens.tobytes(), payload))


def decode_frame(
    value: bytes | bytearray,
    block_hash: bytes,
    namespace: str,
    secret: CacheSecret | None = None,
) -> KVBlock | None:
    """The verified block in `value`, or None when anything does not match."""
    return check_frame(value, block_hash, namespace, secret).block


def _hex(header: dict[str, Any], name: str) -> bytes | None:
    field = header.get(name)
    if not isinstance(field, str):
        return None
    try:
        return bytes.fromhex(field)
    except ValueError:
        return None


def _header(value: bytes | bytearray) -> tuple[dict[str, Any], int] | str:
    if len(value) < _PREFIX.size:
        return f"{len(value)} bytes, shorter than a frame's prefix"
    magic, version, header_len = _PREFIX.unpack_from(value)
    if magic != MAGIC:
        return f"magic {magic!r}, not {MAGIC!r}"
    if version != VERSION:
        return f"format version {version}, not {VERSION}"
    end = _PREFIX.size + header_len
    if header_len > _MAX_HEADER_BYTES or end > len(value):
        return f"header length {header_len} does not fit a {len(value)}-byte value"
    try:
        header = json.loads(bytes(value[_PREFIX.size : end]))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "header is not JSON"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    return header, end


def check_frame(
    value: bytes | bytearray,
    block_hash: bytes,
    namespace: str,
    secret: CacheSecret | None = None,
) -> FrameCheck:
    """Verify `value` as the frame of `block_hash` in `namespace`; with `secret`, a
    frame without a valid MAC is rejected (`MAC_FAILED`). Never raises.

    The KV tensor is a view of `value`, not a copy: restore speed is bound by
    memory traffic, and a copy here cost ~30% of it (a bytearray copy was the
    rejected alternative). When `value` is the `bytes` redis-py returned, the
    tensor is its only holder, so writing to the tensor is harmless even though
    bytes are nominally immutable.
    """
    parsed = _header(value)
    if isinstance(parsed, str):
        return FrameCheck(None, parsed)
    header, tokens_at = parsed
    dtype_name, shape_list, num_tokens = header.get("dtype"), header.get("shape"), header.get("n")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        return FrameCheck(None, f"dtype {dtype_name!r} is not one pagedkv stores")
    # `type(x) is int` also refuses bools and the floats JSON makes of 1e999 or 2.0.
    if not (
        isinstance(shape_list, list)
        and len(shape_list) == 5
        and all(type(x) is int and x >= 0 for x in shape_list)
    ):
        return FrameCheck(None, f"shape {shape_list!r} is not five sizes")
    shape = tuple(cast("list[int]", shape_list))
    if type(num_tokens) is not int or num_tokens != shape[3]:
        return FrameCheck(None, f"token count {num_tokens!r} does not match shape {shape}")
    if header.get("h") != block_hash.hex() or header.get("ns") != namespace:
        return FrameCheck(None, "frame names another block hash or namespace than its key")
    parent_key, checksum = _hex(header, "p"), _hex(header, "c")
    if parent_key is None or checksum is None:
        return FrameCheck(None, "parent key or checksum is not hex")
    kv_at = tokens_at + 4 * num_tokens
    count = math.prod(shape)
    if len(value) != kv_at + count * dtype.itemsize:
        return FrameCheck(None, f"{len(value)} bytes, not what the header's {shape} needs")
    if kv_at % _KV_ALIGN:
        return FrameCheck(None, f"KV at offset {kv_at}, not a multiple of {_KV_ALIGN}")
    tokens = np.frombuffer(value, dtype="<i4", count=num_tokens, offset=tokens_at)
    meta = BlockMeta(block_hash, parent_key, tokens.astype(np.int32), namespace)
    if secret is not None:
        mac = _hex(header, "m")
        parts = _mac_parts(meta, str(dtype_name), shape, memoryview(value)[kv_at:])
        if mac is None or len(mac) != MAC_SIZE or not secret.verify(mac, *parts):
            return FrameCheck(None, MAC_FAILED)
    if count == 0:
        kv = torch.empty(shape, dtype=dtype)
    else:
        kv = torch.frombuffer(value, dtype=dtype, count=count, offset=kv_at).view(shape)
    block = KVBlock(meta, kv)
    if block_checksum(block) != checksum:
        return FrameCheck(None, "checksum does not match")
    return FrameCheck(block)
