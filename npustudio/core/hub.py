"""Talking to the Hugging Face hub (HF_ENDPOINT honoured): bounded waits, and the token kept off plain http.

huggingface_hub's HTTP client has no timeout of its own (`timeout=None`), so an endpoint that accepts a
connection and never answers hung `npustudio info ORG/NAME` forever. Every hub request NPU Studio makes
now gives up after CONNECT_S to connect and HF_HUB_DOWNLOAD_TIMEOUT (huggingface_hub's own setting,
default 10 s) between bytes. The token goes over https; over plain http only to this computer (a local
mirror), with a warning, or when the user says so with NPUSTUDIO_ALLOW_HTTP_TOKEN=1.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

CONNECT_S = 10.0
DEFAULT_READ_S = 10.0
ALLOW_HTTP_TOKEN = "NPUSTUDIO_ALLOW_HTTP_TOKEN"
_installed = False


def endpoint() -> str | None:
    """HF_ENDPOINT, read per call (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def read_timeout_s() -> float:
    try:
        value = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or DEFAULT_READ_S)
    except ValueError:
        return DEFAULT_READ_S
    return value if value > 0 else DEFAULT_READ_S


def bound_waits() -> None:
    """Make every request of huggingface_hub's shared client give up instead of waiting forever."""
    global _installed
    if _installed:
        return
    import huggingface_hub
    from huggingface_hub.utils._http import default_client_factory

    def factory() -> Any:
        client = default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {"request": [*hooks.get("request", []), _bound], "response": hooks.get("response", [])}
        return client

    huggingface_hub.set_client_factory(factory)  # also drops a client made before, without the bound
    _installed = True


def _bound(request: Any) -> None:
    """httpx request hook: a timeout left unset (None: wait forever) becomes a bounded one."""
    limits = {"connect": CONNECT_S, "read": read_timeout_s(), "write": read_timeout_s(), "pool": CONNECT_S}
    current = dict(request.extensions.get("timeout") or {})
    request.extensions["timeout"] = {k: current.get(k) if current.get(k) is not None else v for k, v in limits.items()}


def timed_out(e: BaseException) -> bool:
    """Whether `e`, or what caused it, is an HTTP timeout (huggingface_hub wraps it in other errors)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if "Timeout" in type(cur).__name__ or isinstance(cur, TimeoutError):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def token_for(token: str | None) -> str | None:
    """The token to send to the hub, or None when it must not go: plain http to another machine would show
    it to anyone on the network path. Each case that sends it unencrypted is warned about on stderr."""
    if not token:
        return None
    url = endpoint() or "https://huggingface.co"
    parts = urlsplit(url)
    if parts.scheme.lower() != "http":
        return token
    host = parts.hostname or ""
    if _loopback(host):
        log.warning("HF_ENDPOINT is plain http (%s): the Hugging Face token goes unencrypted, but only to this "
                    "computer (%s).", url, host)
        return token
    if os.environ.get(ALLOW_HTTP_TOKEN) == "1":
        log.warning("The Hugging Face token is sent unencrypted over plain http to %s (%s=1): anyone on the "
                    "network path can read it.", host, ALLOW_HTTP_TOKEN)
        return token
    log.warning("Not sending the Hugging Face token: HF_ENDPOINT is plain http (%s), where anyone on the network "
                "path could read it. Use an https:// endpoint, or set %s=1 to send it anyway.", url,
                ALLOW_HTTP_TOKEN)
    return None


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
