"""The cache secret: a key that authenticates every block a persistent tier stores.

Without it a tier trusts its store: anyone who can write to the SSD directory or
to Redis can put KV there that engines will serve. With a secret, each stored
block carries a MAC over its bytes and its metadata, a block whose MAC fails is
a miss, and the hashing seed is derived from the secret, so it is never stored
where a store's readers could take it.

The secret comes from `CacheConfig.cache_secret`, else the file named by
`CacheConfig.cache_secret_file` (`--cache-secret-file`), else the environment
variable `PAGEDKV_CACHE_SECRET`. Every engine sharing a store needs the same one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

MAC_SIZE = 16  # bytes of a block's MAC
MIN_SECRET_BYTES = 16
ENV_VAR = "PAGEDKV_CACHE_SECRET"


class CacheSecret:
    """Keys the MAC of stored blocks and derives the hashing seed."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cache secret must be at least {MIN_SECRET_BYTES} bytes, got {len(key)}; "
                "make one with: head -c 32 /dev/urandom | base64 > cache.secret"
            )
        # Separate subkeys, so a MAC can never be replayed as a seed or the other way.
        self._mac_key = _derive(key, b"pagedkv block mac")
        self._seed = _derive(key, b"pagedkv hashing seed")[:16]

    @property
    def seed(self) -> bytes:
        """The hashing seed every engine with this secret uses."""
        return self._seed

    def mac(self, *parts: bytes) -> bytes:
        """MAC_SIZE bytes over `parts`; each part's length is included, so parts
        cannot shift into one another."""
        h = hashlib.blake2b(key=self._mac_key, digest_size=MAC_SIZE)
        for part in parts:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def verify(self, mac: bytes, *parts: bytes) -> bool:
        """Whether `mac` is the MAC of `parts` (in constant time)."""
        return hmac.compare_digest(mac, self.mac(*parts))


def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, label, hashlib.sha256).digest()


def load_secret(value: bytes | str | None, file: str | Path | None) -> CacheSecret | None:
    """The configured secret: `value`, else the contents of `file`, else $PAGEDKV_CACHE_SECRET;
    None when none is set. Surrounding whitespace in a file or variable is ignored."""
    if value is None and file is not None:
        path = Path(file).expanduser()
        try:
            value = path.read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the cache secret file {path}: {exc}") from exc
    if value is None:
        value = os.environ.get(ENV_VAR, "").strip() or None
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode()
    return CacheSecret(value)
