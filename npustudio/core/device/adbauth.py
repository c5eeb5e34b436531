"""adb's RSA authentication, device side: which host keys this user trusts, and whether a signature is theirs.

A phone answers the host's CNXN with AUTH TOKEN (20 random bytes); the host signs the token with its
private key (RSA PKCS#1 v1.5, the token taken as a SHA-1 digest: OpenSSL's `RSA_sign(NID_sha1, …)`), and
the phone checks the signature against the keys its user has allowed. The virtual device allows the keys
of this user's own adb: `~/.android/adbkey.pub` (or under `$ANDROID_USER_HOME`) and the keys listed in
`ADB_VENDOR_KEYS`, read at each AUTH because the adb server creates its key on its first start.

adb's public key file is its own format: base64 of a little-endian struct {u32 words (64), u32 n0inv
(-1/n mod 2^32), n[256], rr[256] (2^4096 mod n), u32 e}, then " user@host".
"""

from __future__ import annotations

import base64
import os
import secrets
import struct
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils

TOKEN_SIZE = 20
AUTH_TOKEN, AUTH_SIGNATURE, AUTH_RSAPUBLICKEY = 1, 2, 3
_WORDS = 64  # adb keys are RSA-2048: 64 32-bit words
_STRUCT = struct.Struct(f"<II{_WORDS * 4}s{_WORDS * 4}sI")


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_SIZE)


def parse_public_key(text: str) -> rsa.RSAPublicKey:
    """An adb public key ("BASE64 user@host") as an RSA key; ValueError when it is not one."""
    fields = text.strip().split()
    if not fields:
        raise ValueError("empty key")
    raw = base64.b64decode(fields[0], validate=True)
    if len(raw) != _STRUCT.size:
        raise ValueError(f"{len(raw)} bytes, adb keys have {_STRUCT.size}")
    words, n0inv, n_le, rr_le, e = _STRUCT.unpack(raw)
    n, rr = int.from_bytes(n_le, "little"), int.from_bytes(rr_le, "little")
    if words != _WORDS or n.bit_length() != 2048 or n % 2 == 0:
        raise ValueError("not an RSA-2048 adb key")
    if (n0inv * n + 1) % 2**32 or rr != pow(2, 2 * 2048, n):  # the precomputed values adbd uses must agree
        raise ValueError("inconsistent adb key")
    return rsa.RSAPublicNumbers(e, n).public_key()


def encode_public_key(key: rsa.RSAPublicKey, comment: str = "") -> str:
    """adb's public key format (what `adb keygen` writes to adbkey.pub)."""
    nums = key.public_numbers()
    n = nums.n
    n0inv = (-pow(n, -1, 2**32)) % 2**32
    raw = _STRUCT.pack(_WORDS, n0inv, n.to_bytes(_WORDS * 4, "little"),
                       pow(2, 2 * 2048, n).to_bytes(_WORDS * 4, "little"), nums.e)
    return base64.b64encode(raw).decode() + (f" {comment}" if comment else "")


def sign(key: rsa.RSAPrivateKey, token: bytes) -> bytes:
    """What the adb host sends back for a token (for clients and tests that speak adb themselves)."""
    return key.sign(token, padding.PKCS1v15(), utils.Prehashed(hashes.SHA1()))


def verify(token: bytes, signature: bytes, keys: list[rsa.RSAPublicKey]) -> bool:
    if len(token) != TOKEN_SIZE:
        return False
    for key in keys:
        try:
            key.verify(signature, token, padding.PKCS1v15(), utils.Prehashed(hashes.SHA1()))
            return True
        except (InvalidSignature, ValueError):
            continue
    return False


def _private_key_files() -> list[Path]:
    """This user's adb private keys: adbkey of the user's adb folder, then those in ADB_VENDOR_KEYS."""
    homes = [Path(os.environ["ANDROID_USER_HOME"])] if os.environ.get("ANDROID_USER_HOME") else []
    files = [h / "adbkey" for h in [*homes, Path.home() / ".android"]]
    for entry in filter(None, os.environ.get("ADB_VENDOR_KEYS", "").split(os.pathsep)):
        p = Path(entry)
        files += sorted(p.glob("*.adb_key")) if p.is_dir() else [p]
    return files


def allowed_keys() -> list[rsa.RSAPublicKey]:
    """The public keys of this user's adb (KEY.pub, else derived from the private key file KEY)."""
    keys = []
    for f in _private_key_files():
        try:
            pub = f.with_name(f.name + ".pub")
            if pub.is_file():
                keys.append(parse_public_key(pub.read_text(encoding="ascii")))
            elif f.is_file():
                private = serialization.load_pem_private_key(f.read_bytes(), password=None)
                if isinstance(private, rsa.RSAPrivateKey):
                    keys.append(private.public_key())
        except (OSError, ValueError, TypeError, UnicodeDecodeError):
            continue  # an unreadable or foreign key allows nobody
    return keys
