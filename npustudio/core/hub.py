"""Talking to the Hugging Face hub (HF_ENDPOINT honoured): bounded waits, and the token kept off plain http.

huggingface_hub's HTTP client has no timeout of its own (`timeout=None`), so an endpoint that accepts a
connection and never answers hung `npustudio info ORG/NAME` forever. Every hub request NPU Studio makes
now gives up after CONNECT_S to connect and HF_HUB_DOWNLOAD_TIMEOUT (huggingface_hub's own setting,
default 10 s) between bytes. That limit is per silence: an endpoint that trickles a byte every few seconds
never trips it, so every request also has an overall deadline: PER_SILENCE times its own read timeout for its
answer, plus one second per MIN_RATE bytes received (a large file on a slow link goes on, a trickle does not).
The token goes over https; over plain http only to this computer (a local mirror), with a warning, or when the
user says so with NPUSTUDIO_ALLOW_HTTP_TOKEN=1.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from .errors import UserError

log = logging.getLogger(__name__)

CONNECT_S = 10.0
DEFAULT_READ_S = 10.0
PER_SILENCE = 6  # a request's whole answer (headers, an API reply, a small file) arrives within this many times
# its read timeout (60 s for the default 10 s; huggingface_hub's own short best-effort requests stay short) ...
MIN_RATE = 32 * 1024  # ... plus one second per this many bytes received (bytes per second a download keeps up)
ALLOW_HTTP_TOKEN = "NPUSTUDIO_ALLOW_HTTP_TOKEN"
_installed = False


def endpoint() -> str | None:
    """HF_ENDPOINT, read per call (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def check_endpoint() -> None:
    """A UserError naming HF_ENDPOINT when it is set to something that is not an http(s) URL of a host (the HTTP
    client would fail on it with an error that reads like a bug)."""
    url = endpoint()
    if url is None:
        return
    try:
        parts = urlsplit(url.strip())
        ok = parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        ok = False
    if not ok:
        raise UserError(f"HF_ENDPOINT is set to {url!r}, which is not the URL of a hub.",
                        "Set HF_ENDPOINT to a Hugging Face hub or mirror as http(s)://HOST[:PORT] (e.g. "
                        "https://huggingface.co), or unset it.")


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
        # httpx2 has no overall timeout and no public way to set one: the connection pools' network backend (the
        # direct one and any proxy's) is wrapped, whose streams keep each request's deadline
        for transport in [client._transport, *client._mounts.values()]:
            pool = getattr(transport, "_pool", None)
            if pool is not None and not isinstance(pool._network_backend, _DeadlineBackend):
                pool._network_backend = _DeadlineBackend(pool._network_backend)
        return client

    huggingface_hub.set_client_factory(factory)  # also drops a client made before, without the bound
    _installed = True


def _bound(request: Any) -> None:
    """httpx request hook: a timeout left unset (None: wait forever) becomes a bounded one."""
    limits = {"connect": CONNECT_S, "read": read_timeout_s(), "write": read_timeout_s(), "pool": CONNECT_S}
    current = dict(request.extensions.get("timeout") or {})
    request.extensions["timeout"] = {k: current.get(k) if current.get(k) is not None else v for k, v in limits.items()}


class TooSlow(Exception):
    """A hub request that did not finish within its overall deadline. Deliberately not an httpx timeout: the
    hub client resumes a download after a timeout, for ever while bytes keep trickling in."""


def _deadline_s(received: int, read_s: float | None) -> float:
    return PER_SILENCE * (read_s or read_timeout_s()) + received / MIN_RATE


class _DeadlineStream:
    """A connection whose reads stop at the current request's deadline. A request starts with the first write
    after the previous answer's reads (HTTP/1.1: one request at a time on a connection)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.start = time.monotonic()
        self.received = 0
        self.reading = False

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self.reading:  # the next request on a kept-alive connection
            self.start, self.received, self.reading = time.monotonic(), 0, False
        self.inner.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        import httpcore2

        self.reading = True
        left = self.start + _deadline_s(self.received, timeout) - time.monotonic()
        if left <= 0:
            raise TooSlow(self._why(timeout))
        try:
            data: bytes = self.inner.read(max_bytes, left if timeout is None else min(timeout, left))
        except httpcore2.ReadTimeout:
            if timeout is None or left < timeout:
                raise TooSlow(self._why(timeout)) from None
            raise
        self.received += len(data)
        return data

    def _why(self, read_s: float | None) -> str:
        return (f"{self.received} bytes in {time.monotonic() - self.start:.0f} s, where a request may take "
                f"{_deadline_s(0, read_s):g} s plus 1 s per {MIN_RATE // 1024} KiB received")

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> _DeadlineStream:
        return _DeadlineStream(self.inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _DeadlineBackend:
    """httpcore2's network backend, its connections bounded by `_DeadlineStream`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> _DeadlineStream:
        return _DeadlineStream(self.inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> _DeadlineStream:
        return _DeadlineStream(self.inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def too_slow(e: BaseException) -> TooSlow | None:
    """`e`, or what caused it, when it is a request past its overall deadline."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, TooSlow):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


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
