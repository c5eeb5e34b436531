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


def no_keyring() -> str | None:
    """Why no system keyring can hold the token (keyring's null/fail backends accept a secret and keep
    nothing), or None when one can."""
    try:
        import keyring
        from keyring.backends import fail, null

        kr = keyring.get_keyring()
    except Exception as e:  # e.g. PYTHON_KEYRING_BACKEND naming nothing
        return f"the keyring cannot be loaded ({e.__class__.__name__}: {e})"
    backends = list(getattr(kr, "backends", [kr]))  # a chainer tries several
    if not backends or all(isinstance(b, fail.Keyring | null.Keyring) for b in backends):
        return f"the keyring backend is {kr.__class__.__module__}, which stores nothing"
    return None


def set_hf_token(token: str) -> None:
    """Store the token in the system keyring, and read it back: a UserError when nothing would keep it."""
    from .errors import UserError

    fix = ("Install and unlock a system keyring (GNOME Keyring, KWallet, ...), or set HF_TOKEN for this session "
           "only.")
    why = no_keyring()
    if why:
        raise UserError(f"There is no usable system keyring ({why}), so the token cannot be stored.", fix)
    import keyring

    try:
        keyring.set_password(SERVICE, USER, token)
        kept = keyring.get_password(SERVICE, USER)
    except Exception as e:
        raise UserError(f"The system keyring refused the token ({e.__class__.__name__}).", fix) from None
    if kept != token:
        raise UserError("The system keyring took the token but does not give it back, so it is not stored.", fix)


def delete_hf_token() -> None:
    """Remove the stored token; a UserError when no usable keyring holds one (the null backend "deletes" without
    a word, and saying "removed" there would claim what did not happen) or the keyring refuses."""
    from .errors import UserError

    why = no_keyring()
    if why:
        fix = ("The token in use comes from HF_TOKEN: unset it in this environment." if os.environ.get("HF_TOKEN")
               else "There is no token to remove; to store one, install and unlock a system keyring (GNOME "
                    "Keyring, KWallet, ...).")
        raise UserError(f"There is no usable system keyring ({why}), so no token was stored there and nothing "
                        "was removed.", fix)
    import keyring
    from keyring.errors import PasswordDeleteError

    try:
        keyring.delete_password(SERVICE, USER)
    except PasswordDeleteError:
        pass
    except Exception as e:
        raise UserError(f"The system keyring refused to remove the token ({e.__class__.__name__}).",
                        "Unlock the keyring, then try again.") from None


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
    from . import hub

    hub.check_endpoint()
    if hub.token_for(token) is None:
        raise UserError("The token was not checked: HF_ENDPOINT is plain http, which would show it to the network.",
                        f"Use an https:// HF_ENDPOINT, or set {hub.ALLOW_HTTP_TOKEN}=1; the token can be saved "
                        "without checking.")
    hub.bound_waits()
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        info = HfApi(endpoint=hub.endpoint()).whoami(token=token, cache=False)
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
