"""The Hugging Face token: kept only in the system keyring (or the HF_TOKEN environment variable).

Never written to a file or a log. Every keyring call is guarded: a broken or missing keyring backend
degrades to "no stored token", it never crashes the app.
"""

from __future__ import annotations

import logging
import os

SERVICE = "npustudio"
USER = "huggingface"
log = logging.getLogger(__name__)


def get_hf_token() -> str | None:
    """Keyring first, then HF_TOKEN."""
    try:
        import keyring

        tok = keyring.get_password(SERVICE, USER)
        if tok:
            return tok
    except Exception as e:  # a keyring backend may fail in many ways; never crash for it
        log.warning("keyring unavailable (%s); using HF_TOKEN if set", e.__class__.__name__)
    return os.environ.get("HF_TOKEN") or None


def set_hf_token(token: str) -> None:
    import keyring

    keyring.set_password(SERVICE, USER, token)


def delete_hf_token() -> None:
    import keyring
    from keyring.errors import PasswordDeleteError

    try:
        keyring.delete_password(SERVICE, USER)
    except PasswordDeleteError:
        pass


def redact(text: str, token: str | None) -> str:
    return text.replace(token, "hf_***") if token else text
