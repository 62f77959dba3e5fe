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
    """Who sent a request. `salt` is None when the server has no keys (one tenant).
    `label` names the key in logs without showing it: `keyN`, the Nth API key the
    server was given, or `adminN`, the Nth admin key; "-" without keys."""

    salt: str | None
    is_admin: bool
    label: str = "-"

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

    Admin rule: a key is an admin key only when it is named in `admin_keys`
    (admin keys are valid API keys as well). Every other key is a tenant that
    may use the model and see its own figures, never clear the cache or see
    other tenants' totals. A server with no keys at all is single-user: its
    one caller (`ANONYMOUS`) is the admin. The rejected alternative, every key
    an admin when no admin key is named, let any tenant wipe the shared cache.
    """

    def __init__(self, api_keys: Iterable[str], admin_keys: Iterable[str] | None = ()) -> None:
        keys = list(dict.fromkeys(k for k in api_keys if k))
        admins = list(dict.fromkeys(k for k in admin_keys or () if k))
        labels = {k: f"key{i}" for i, k in enumerate(keys, 1)}
        labels.update({k: f"admin{i}" for i, k in enumerate(admins, 1)})
        self._tenants: dict[bytes, Tenant] = {}
        for key, label in labels.items():
            salt = "tenant:" + hmac.new(_SALT_KEY, key.encode(), hashlib.sha256).hexdigest()
            self._tenants[_digest(key)] = Tenant(salt, is_admin=key in admins, label=label)
        self.num_admins = len(admins)

    @property
    def num_keys(self) -> int:
        return len(self._tenants)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def lookup(self, key: str) -> Tenant | None:
        return self._tenants.get(_digest(key))

    def salts(self) -> list[str]:
        """Every key's salt, for the admin's explain (`other_tenant`); never shown."""
        return [t.salt for t in self._tenants.values() if t.salt is not None]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
