"""The namespace: one string naming everything that decides a block's KV besides
its tokens and the request's extra keys (format 2, "identity v2").

The model adapter gathers the fields (`ModelAdapter.identity`); this module only
encodes them, so a router or another language can compute the same namespace,
and from it the same block keys, from the spec in docs/architecture.md
("Cache identity") and the vectors in docs/identity_vectors.json.

Encoding: ``sha256(NAMESPACE_DOMAIN || field_1 || ... || field_n)``, its first 16
bytes as 32 lowercase hex characters, where every field of `NAMESPACE_FIELDS`
appears once, in that order, as ``u8 len(name) || name || u32-LE len(value) ||
value`` (UTF-8). Every field is required: a field that could be left out would let
two identities that differ only in whether it is there encode alike; a field that
does not apply has a value that says so ("none"). Rejected: the JSON dump the
format-1 fingerprint hashed, whose bytes depend on a serializer's spacing and
float printing, which another language cannot be sure to reproduce.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

__all__ = ["NAMESPACE_DOMAIN", "NAMESPACE_FIELDS", "encode_fields", "namespace_digest"]

NAMESPACE_DOMAIN = b"pagedkv-namespace\x00v2\x00"
# The order is part of the format; a new field is a new format (a new domain).
NAMESPACE_FIELDS = (
    "layout",  # KV_LAYOUT_VERSION: what a stored row means
    "backend",  # the compute library ("torch"; an MLX backend rounds otherwise)
    "device",  # the device type the kernels run on ("cpu", "cuda")
    "weights",  # the weights digest (`model.fingerprint.weights_digest`)
    "config",  # canonical JSON of the config fields that reach the forward pass
    "dtype",  # the parameters' dtype
    "kv_dtype",  # how KV is stored (the model's dtype when kv_dtype is auto)
    "linear",  # the linear layers' kernel ("torch", "onednn-packed:isa<=...", "int8-pair")
    "attention",  # the attention kernel and the shape family prompt chunks use
    "mode",  # how a step's rows are batched ("grouped", "deterministic", "one-sequence")
    "block_size",  # tokens per block, decimal
)


def encode_fields(fields: Mapping[str, str]) -> bytes:
    """The bytes the namespace digest is taken over (domain included). Refuses a
    missing, unknown or non-string field by name."""
    unknown = sorted(set(fields) - set(NAMESPACE_FIELDS))
    missing = [name for name in NAMESPACE_FIELDS if name not in fields]
    if unknown or missing:
        raise ValueError(
            f"namespace fields must be exactly {', '.join(NAMESPACE_FIELDS)}; "
            f"unknown: {unknown or 'none'}, missing: {missing or 'none'}"
        )
    out = bytearray(NAMESPACE_DOMAIN)
    for name in NAMESPACE_FIELDS:
        value = fields[name]
        if not isinstance(value, str):
            raise TypeError(f"namespace field {name!r} must be a str, got {value!r}")
        raw = value.encode()
        out += struct.pack("<B", len(name)) + name.encode()
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def namespace_digest(fields: Mapping[str, str]) -> str:
    """The namespace of `fields`: 32 hex characters (see the module docstring)."""
    return hashlib.sha256(encode_fields(fields)).hexdigest()[:32]
