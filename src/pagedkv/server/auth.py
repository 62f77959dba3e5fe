"""API keys and the cache salt each key (tenant) gets.

A tenant's salt is HMAC-SHA256(_SALT_KEY, api key). It is folded into the
root of every block hash the tenant's requests make, so tenants share no
cached block: one tenant can neither reuse another's prefix nor time it (a hit
would be faster). The salt is derived, not random, so a tenant's entries in a
persistent tier still match after a restart; it never leaves the server, and
without the key it cannot be computed. A request's `cache_salt` is appended to
the tenant's salt: it narrows the sharing further and can never widen it,
because the tenant part is always present and has a fixed length.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

_SALT_KEY = b"pagedkv tenant cache salt v1"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sent a request. `salt` is None when the server has no keys (one tenant)."""

    salt: str | None
    is_admin: bool

    def cache_salt(self, request_salt: str | None) -> str | None:
        if self.salt is None:
            return request_salt
        if request_salt is None:
            return self.salt
        return f"{self.salt}/{request_salt}"


ANONYMOUS = Tenant(salt=None, is_admin=True)


class KeyRing:
    """The valid keys. Lookup is by SHA-256 digest, so its time does not depend
    on how much of a wrong key matched.

    Admin rule: when `admin_keys` is None every key is an admin key (a single
    operator with one key can clear the cache); when it is given, only those
    keys may call admin endpoints, and they are valid API keys as well.
    """

    def __init__(self, api_keys: Iterable[str], admin_keys: Iterable[str] | None) -> None:
        keys = [k for k in api_keys if k]
        admins = None if admin_keys is None else [k for k in admin_keys if k]
        self._tenants: dict[bytes, Tenant] = {}
        for key in [*keys, *(admins or [])]:
            is_admin = admins is None or key in admins
            salt = "tenant:" + hmac.new(_SALT_KEY, key.encode(), hashlib.sha256).hexdigest()
            self._tenants[_digest(key)] = Tenant(salt=salt, is_admin=is_admin)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def lookup(self, key: str) -> Tenant | None:
        return self._tenants.get(_digest(key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
