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


def validate_hf_token(token: str) -> str:
    """Ask the hub (HF_ENDPOINT honoured) who the token belongs to; the account name, or a UserError.

    The token travels only in the Authorization header; messages never contain it.
    """
    from .errors import UserError

    token = token.strip()
    if not token:
        raise UserError("No token given.", "Paste the token from https://huggingface.co/settings/tokens.")
    if any(c.isspace() for c in token):
        raise UserError("The token contains spaces.", "Copy it again from https://huggingface.co/settings/tokens.")
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        # HF_ENDPOINT read per call (huggingface_hub reads it once, at import)
        info = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).whoami(token=token, cache=False)
    except HfHubHTTPError as e:
        code = getattr(getattr(e, "response", None), "status_code", None)
        if code in (401, 403):
            raise UserError("The Hugging Face hub does not accept this token.",
                            "Create a new read token at https://huggingface.co/settings/tokens.") from None
        raise UserError(f"The hub answered with an error ({code}).", "Try again later.") from None
    except Exception as e:  # httpx/OS connection errors: offline
        raise UserError(f"The Hugging Face hub cannot be reached ({e.__class__.__name__}).",
                        "Check the network; the token can be saved without checking.") from None
    return str(info.get("name", "?"))
