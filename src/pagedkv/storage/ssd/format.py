"""On-disk format of one SSD block: a safetensors file, plus where it lives.

A block file is a valid safetensors file (readable by `safetensors.safe_open`)
holding two tensors, `kv` first and `token_ids` (int32) after it, and a
`__metadata__` dict with the format name and version, the block's hash,
parent key, namespace, token count and checksum (`base.block_checksum`, hex),
and, when the store has a cache secret, a MAC (`CacheSecret.mac`, hex) over the
format version, every metadata field, both tensors' dtypes and shapes, the
SHA-256 of the KV bytes and the token ids. The checksum is unkeyed: it catches
damage, not forgery; with a secret, a file whose MAC is absent or wrong is a
`BlockAuthenticationError`.

We write and parse the format ourselves rather than through
`safetensors.torch.save`/`load`: those build the whole file as one bytes object
and copy every tensor once more, while here the KV goes from the tensor's
memory to the file and from the file into the returned tensor's memory with no
copy in between, which is what lets a restore run at disk speed. The parser is
strict and total: any bytes at all give a block or a `CacheCorruptionError`
(which the store turns into a miss), never another exception; hypothesis fuzzes
that (`tests/storage/test_ssd_hardening.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct

import numpy as np
import torch

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.base import BlockMeta, KVBlock, block_checksum
from pagedkv.storage.secret import CacheSecret

FORMAT_NAME = "pagedkv.block"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 1 << 20
_MAX_DIM = 1 << 31  # a larger dimension is nonsense, and torch overflows on some


class BlockAuthenticationError(CacheCorruptionError):
    """A block file's MAC is missing or does not verify under the cache secret."""


_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def _mac(
    secret: CacheSecret,
    meta: dict[str, str],
    tensors: list[tuple[str, list[int]]],
    kv: memoryview,
    tokens: memoryview,
) -> bytes:
    """The MAC of everything a reader trusts: the metadata (but the MAC itself), the
    tensors' dtypes and shapes, the SHA-256 of the KV bytes and the token ids.

    The keyed hash runs over a digest of the KV, not the KV itself: SHA-256 has
    hardware instructions on current x86 and ARM CPUs (1200 MB/s here against
    537 MB/s for BLAKE2b, `benchmarks/bench_ssd_decode.py`), and the KV is
    almost all of a file. Its collision resistance is what keeps the MAC
    binding; xxh3 (the checksum, 18 GB/s) was rejected for that role: its
    collisions can be constructed.
    """
    fields = {k: v for k, v in meta.items() if k != "mac"}
    described = json.dumps([fields, tensors], sort_keys=True, separators=(",", ":")).encode()
    # hashlib reads the buffer in place: no copy of the KV.
    return secret.mac(described, hashlib.sha256(kv).digest(), bytes(tokens))


def encode_file(
    block: KVBlock, checksum: bytes, secret: CacheSecret | None = None
) -> tuple[bytes, list[memoryview]]:
    """The file's prefix (length + JSON header) and the data buffers to write after it."""
    kv = block.kv.detach().cpu().contiguous()
    dtype_name = _DTYPES.get(kv.dtype)
    if dtype_name is None:
        raise ValueError(
            f"SSD store cannot hold KV of dtype {kv.dtype}; use one of {list(_DTYPES)}"
        )
    tokens = np.ascontiguousarray(block.meta.token_ids, dtype="<i4")
    kv_bytes = kv.numel() * kv.element_size()
    meta = block.meta
    header = {
        "__metadata__": {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "hash": meta.block_hash.hex(),
            "parent_hash": meta.parent_key.hex(),
            "namespace": meta.namespace,
            "num_tokens": str(meta.num_tokens),
            "checksum": checksum.hex(),
        },
        "kv": {"dtype": dtype_name, "shape": list(kv.shape), "data_offsets": [0, kv_bytes]},
        "token_ids": {
            "dtype": "I32",
            "shape": [int(tokens.shape[0])],
            "data_offsets": [kv_bytes, kv_bytes + tokens.nbytes],
        },
    }
    buffers = [tokens.view(np.uint8).data]
    if kv_bytes:
        buffers.insert(0, kv.view(torch.uint8).reshape(-1).numpy().data)
    if secret is not None:
        kv_view = buffers[0] if kv_bytes else memoryview(b"")
        tensors = [(dtype_name, list(kv.shape)), ("I32", [int(tokens.shape[0])])]
        metadata: dict[str, str] = header["__metadata__"]  # type: ignore[assignment]
        metadata["mac"] = _mac(secret, metadata, tensors, kv_view, buffers[-1]).hex()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-aligned, as safetensors pads it
    return struct.pack("<Q", len(text)) + text, buffers


def file_size(prefix: bytes, buffers: list[memoryview]) -> int:
    return len(prefix) + sum(b.nbytes for b in buffers)


def _tensor_entry(header: dict[str, object], name: str) -> tuple[str, list[int], int, int]:
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise CacheCorruptionError(f"block file has no tensor {name!r}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        not isinstance(dtype, str)
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
    ):
        raise CacheCorruptionError(f"block file has a malformed entry for {name!r}")
    return dtype, shape, offsets[0], offsets[1]


def parse_header(buf: memoryview) -> tuple[dict[str, object], int]:
    """The JSON header and the offset where data starts; checks only the framing."""
    if len(buf) < 8:
        raise CacheCorruptionError(f"block file is {len(buf)} bytes, shorter than its framing")
    (length,) = struct.unpack_from("<Q", buf, 0)
    if length > MAX_HEADER_BYTES or 8 + length > len(buf):
        raise CacheCorruptionError(f"block file header length {length} is impossible")
    try:
        header = json.loads(bytes(buf[8 : 8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheCorruptionError(f"block file header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CacheCorruptionError("block file header is not a JSON object")
    return header, 8 + length


def header_meta(header: dict[str, object]) -> dict[str, str]:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CacheCorruptionError("file is not a pagedkv block")
    if meta.get("version") != FORMAT_VERSION:
        raise CacheCorruptionError(f"block format version {meta.get('version')!r} is not ours")
    return {str(k): str(v) for k, v in meta.items()}


def decode_file(
    data: torch.Tensor,
    expected_hash: bytes,
    namespace: str | None = None,
    secret: CacheSecret | None = None,
) -> tuple[KVBlock, bytes]:
    """Parse and verify a whole block file held in `data` (uint8, 1-D).

    Returns the block (its KV is a view into `data`, no copy) and its checksum.
    `namespace` None accepts any namespace (maintenance). With `secret`, the MAC
    must verify (`BlockAuthenticationError` otherwise). Raises
    `CacheCorruptionError` on anything inconsistent, and nothing else, whatever
    the bytes: the explicit checks come first, and the guard below turns what
    they missed (numpy, torch, struct, overflow) into the same error.
    """
    try:
        return _decode(data, expected_hash, namespace, secret)
    except CacheCorruptionError:
        raise
    except (ValueError, TypeError, OverflowError, RuntimeError, IndexError, KeyError,
            RecursionError, struct.error) as exc:  # fmt: skip
        raise CacheCorruptionError(f"block file is malformed ({type(exc).__name__})") from None


def _decode(
    data: torch.Tensor, expected_hash: bytes, namespace: str | None, secret: CacheSecret | None
) -> tuple[KVBlock, bytes]:
    raw = data.numpy().data
    header, start = parse_header(raw)
    meta = header_meta(header)
    kv_dtype, kv_shape, kv_lo, kv_hi = _tensor_entry(header, "kv")
    tok_dtype, tok_shape, tok_lo, tok_hi = _tensor_entry(header, "token_ids")
    dtype = _BY_NAME.get(kv_dtype)
    if dtype is None or tok_dtype != "I32" or len(kv_shape) != 5 or len(tok_shape) != 1:
        raise CacheCorruptionError("block file tensors have unexpected dtypes or ranks")
    if any(d >= _MAX_DIM for d in [*kv_shape, *tok_shape]):
        raise CacheCorruptionError("block file has an impossible tensor dimension")
    item = torch.empty((), dtype=dtype).element_size()
    num_tokens = tok_shape[0]
    kv_len, tok_len, data_len = kv_hi - kv_lo, tok_hi - tok_lo, len(raw) - start
    # Either order is valid safetensors (the library puts the wider dtype first).
    ranges = sorted([(kv_lo, kv_hi), (tok_lo, tok_hi)])
    if (
        kv_len != math.prod(kv_shape) * item
        or tok_len != 4 * num_tokens
        or ranges[0][0] != 0
        or ranges[0][1] != ranges[1][0]
        or ranges[1][1] != data_len
        or (start + kv_lo) % item
    ):
        raise CacheCorruptionError(
            f"block file layout disagrees with its header ({data_len} data bytes)"
        )
    if kv_shape[3] != num_tokens or meta.get("num_tokens") != str(num_tokens):
        raise CacheCorruptionError("block file token counts disagree")
    if meta.get("hash") != expected_hash.hex():
        raise CacheCorruptionError("block file holds another block's hash")
    if namespace is not None and meta.get("namespace") != namespace:
        raise CacheCorruptionError("block file belongs to another namespace")
    try:
        parent = bytes.fromhex(meta["parent_hash"])
        checksum = bytes.fromhex(meta["checksum"])
    except (KeyError, ValueError):
        raise CacheCorruptionError("block file metadata is malformed") from None
    if secret is not None:
        tensors = [(kv_dtype, kv_shape), (tok_dtype, tok_shape)]
        kv_raw, tok_raw = raw[start + kv_lo : start + kv_hi], raw[start + tok_lo : start + tok_hi]
        _check_mac(secret, meta, tensors, kv_raw, tok_raw)
    tokens = np.frombuffer(raw, dtype="<i4", count=num_tokens, offset=start + tok_lo)
    if kv_len:
        kv = data[start + kv_lo : start + kv_hi].view(dtype).view(kv_shape)
    else:
        kv = torch.empty(kv_shape, dtype=dtype)
    block_meta = BlockMeta(
        expected_hash, parent, tokens.astype(np.int32), meta.get("namespace", "")
    )
    block = KVBlock(block_meta, kv)
    if block_checksum(block) != checksum:
        raise CacheCorruptionError("block file checksum does not match its contents")
    return block, checksum


def _check_mac(
    secret: CacheSecret,
    meta: dict[str, str],
    tensors: list[tuple[str, list[int]]],
    kv: memoryview,
    tokens: memoryview,
) -> None:
    try:
        mac = bytes.fromhex(meta["mac"])
    except (KeyError, ValueError):
        raise BlockAuthenticationError("block file carries no MAC, and a secret is set") from None
    if not hmac.compare_digest(mac, _mac(secret, meta, tensors, kv, tokens)):
        raise BlockAuthenticationError("block file MAC does not verify under the cache secret")
