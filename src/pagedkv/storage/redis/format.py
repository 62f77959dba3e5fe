"""The frame that holds one KV block as a Redis value.

    offset 0   4s  magic b"PKVR"
           4   B   format version (1)
           5   3x  reserved, zero
           8   <I  header length H
          12   H   JSON header {"h", "p", "ns", "dtype", "shape", "n", "c"}: block
                   hash and parent key (hex), namespace, torch dtype name, KV shape,
                   token count, block_checksum (hex); space-padded so the KV starts
                   at a multiple of 64 bytes
     12 + H    4n  token ids, int32 little-endian
     then          raw KV bytes, C order, `shape` x `dtype`

A JSON header (not a fixed struct) lets later versions add fields; it costs
microseconds against milliseconds of transfer per block.
"""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import torch

from pagedkv.storage.base import BlockMeta, KVBlock, block_checksum

MAGIC = b"PKVR"
VERSION = 1
_PREFIX = struct.Struct("<4sBxxxI")
_KV_ALIGN = 64
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


def encode_frame(block: KVBlock) -> bytes:
    """The stored frame of `block` (layout above).

    Raises ValueError for a dtype that `decode_frame` would reject.
    """
    kv = block.kv.detach().contiguous().cpu()
    if str(kv.dtype).removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"cannot store KV of dtype {kv.dtype} in Redis; use one of {[*_DTYPES]}")
    meta = block.meta
    tokens = np.ascontiguousarray(meta.token_ids, dtype="<i4")
    header = {
        "h": meta.block_hash.hex(),
        "p": meta.parent_key.hex(),
        "ns": meta.namespace,
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": list(kv.shape),
        "n": int(tokens.shape[0]),
        "c": block_checksum(KVBlock(meta, kv)).hex(),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(_PREFIX.size + len(raw) + tokens.nbytes) % _KV_ALIGN)
    payload = kv.view(torch.uint8).numpy().data if kv.numel() else b""
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(raw)), raw, tokens.tobytes(), payload))


def decode_frame(value: bytes | bytearray, block_hash: bytes, namespace: str) -> KVBlock | None:
    """The verified block in `value`, or None when anything does not match.

    The KV tensor is a view of `value`, not a copy: restore speed is bound by
    memory traffic, and a copy here cost ~30% of it (a bytearray copy was the
    rejected alternative). When `value` is the `bytes` redis-py returned, the
    tensor is its only holder, so writing to the tensor is harmless even though
    bytes are nominally immutable.
    """
    try:
        magic, version, header_len = _PREFIX.unpack_from(value)
        if magic != MAGIC or version != VERSION:
            return None
        header = json.loads(bytes(value[_PREFIX.size : _PREFIX.size + header_len]))
        dtype = _DTYPES.get(header["dtype"])
        shape = tuple(int(x) for x in header["shape"])
        num_tokens = int(header["n"])
        if (
            header["h"] != block_hash.hex()
            or header["ns"] != namespace
            or dtype is None
            or len(shape) != 5
            or min(shape) < 0
            or shape[3] != num_tokens
        ):
            return None
        tokens_at = _PREFIX.size + header_len
        kv_at = tokens_at + 4 * num_tokens
        count = int(np.prod(shape))
        if len(value) != kv_at + count * dtype.itemsize:
            return None
        tokens = np.frombuffer(value, dtype="<i4", count=num_tokens, offset=tokens_at)
        meta = BlockMeta(block_hash, bytes.fromhex(header["p"]), tokens.astype(np.int32), namespace)
        if count == 0:
            kv = torch.empty(shape, dtype=dtype)
        else:
            kv = torch.frombuffer(value, dtype=dtype, count=count, offset=kv_at).view(shape)
        block = KVBlock(meta, kv)
        if block_checksum(block) != bytes.fromhex(header["c"]):
            return None
        return block
    except (ValueError, KeyError, TypeError, struct.error, RuntimeError):
        return None
