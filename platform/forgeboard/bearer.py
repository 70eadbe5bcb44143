"""Bearer tokens `<kind>_<prefix>_<secret>`: the prefix is stored to find the token, only a hash of the whole."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX_BYTES = 6
SECRET_BYTES = 24


@dataclass(frozen=True)
class MintedToken:
    prefix: str
    raw: str
    token_hash: str


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def mint_token(kind: str) -> MintedToken:
    prefix = secrets.token_hex(PREFIX_BYTES)
    raw = f"{kind}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    return MintedToken(prefix=prefix, raw=raw, token_hash=hash_token(raw))


HEX_DIGITS = frozenset("0123456789abcdef")


def token_prefix(raw: object, kind: str) -> str | None:
    """The prefix of a token of this kind that could have been minted (lowercase hex), else None: nothing else
    is worth a database query (a NUL or other junk in it would not even be storable)."""
    parts = raw.split("_", 2) if isinstance(raw, str) else []
    if len(parts) != 3 or parts[0] != kind or len(parts[1]) != 2 * PREFIX_BYTES or not HEX_DIGITS.issuperset(parts[1]):
        return None
    return parts[1]


def token_matches(raw: str, token_hash: str) -> bool:
    return hmac.compare_digest(token_hash, hash_token(raw))
