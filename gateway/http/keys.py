"""API keys: who is calling, and for which tenant.

The keys file holds no key, only each key's SHA-256 (so a leaked file opens nothing):

    {"keys": [{"name": "shop-web", "sha256": "<hex>", "tenant": "shop"}]}

A request names its key in ``x-api-key`` or ``Authorization: Bearer <key>``. ``tenant`` is
the tenant the gateway acts for with that key (``admin: true`` lets the key's holder see every
tenant in the console, docs/console.md) (the gateway's broker user must be trusted by
the workers, ``LOOPWIRE_TENANTS__TRUSTED``); without it (tenancy off) the key acts for the one
fleet-wide tenant. ``loopwire gateway key`` makes a key and the line for the file.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from pydantic import BaseModel, Field

from contracts import tenancy


class ApiKey(BaseModel):
    name: str = Field(min_length=1, max_length=100)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, hex.")
    tenant: str | None = Field(default=None, description="The tenant it acts for.")
    admin: bool = Field(
        default=False,
        description="In the console, sees every tenant and switches between them (docs/console.md).",
    )

    def model_post_init(self, _: object) -> None:
        if self.tenant is not None and not tenancy.valid(self.tenant):
            raise ValueError(f"key {self.name!r}: not a tenant name: {self.tenant[:64]!r}")


class KeysFile(BaseModel):
    keys: list[ApiKey] = Field(min_length=1)


class ApiKeys:
    def __init__(self, keys: list[ApiKey]) -> None:
        self._by_hash = {key.sha256: key for key in keys}

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        return cls(KeysFile.model_validate_json(path.read_bytes()).keys)

    @classmethod
    def load_entries(cls, entries: list[dict[str, object]]) -> ApiKeys:
        """The keys of the file's ``keys`` list, given as data."""
        return cls(KeysFile.model_validate({"keys": entries}).keys)

    def find(self, presented: str) -> ApiKey | None:
        """The key ``presented`` is, or None (compared by hash, in constant time)."""
        digest = hashlib.sha256(presented.encode()).hexdigest()
        found = None
        for known, key in self._by_hash.items():
            if hmac.compare_digest(known, digest):
                found = key
        return found


def new_key(name: str, tenant: str | None) -> tuple[str, ApiKey]:
    """A fresh key and its entry for the keys file."""
    key = "lwk_" + secrets.token_urlsafe(32)
    return key, ApiKey(name=name, sha256=hashlib.sha256(key.encode()).hexdigest(), tenant=tenant)
