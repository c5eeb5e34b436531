"""A loopback Hugging Face hub: the endpoints `snapshot_download` uses, served from a local folder.

Set HF_ENDPOINT to its URL. Repos listed in `gated` answer 401/403 with X-Error-Code GatedRepo unless the
request carries the accepted token, as the real hub does; `broken` repos answer their API call with JSON cut
short. `SilentHub` accepts connections and never answers; `RawHub` trickles or sends garbage.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path], gated: dict[str, str] | None = None,
                 broken: tuple[str, ...] = ()) -> None:
        self.repos = repos
        self.gated = gated or {}  # repo -> token that has access
        self.broken = broken  # repos whose API call answers with JSON cut short
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _send(self, h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict[str, str],
              head: bool) -> None:
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        auth = h.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ") if auth else None
        self.requests.append((h.command, path, token))
        if path == "/api/whoami-v2":  # a token is valid when it opens some gated repo here
            if token and token in self.gated.values():
                return self._send(h, 200, json.dumps({"type": "user", "name": "tester"}).encode(),
                                  {"Content-Type": "application/json"}, head)
            return self._send(h, 401, b'{"error":"Invalid credentials in Authorization header"}', {}, head)
        m = (re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?$", path)
             or re.match(r"^/([^/]+/[^/]+)/(resolve)/([^/]+)/(.+)$", path))
        if not m:
            return self._send(h, 404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
        repo, kind = m.group(1), m.group(2)
        if repo not in self.repos:
            return self._send(h, 401, b'{"error":"Repository not found"}',
                              {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, head)
        if repo in self.gated and token != self.gated[repo]:
            return self._send(h, 401 if token is None else 403,
                              b'{"error":"Access to model is restricted"}',
                              {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}, head)
        folder = self.repos[repo]
        files = sorted(f for f in folder.iterdir() if f.is_file())
        if kind == "revision" and repo in self.broken:
            cut = b'{"id": "' + repo.encode() + b'", "sha": "01'
            return self._send(h, 200, cut, {"Content-Type": "application/json"}, head)
        if kind == "revision":
            body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT,
                               "siblings": [{"rfilename": f.name} for f in files]}).encode()
            return self._send(h, 200, body, {"Content-Type": "application/json"}, head)
        if kind == "tree":
            entries = [{"type": "file", "path": f.name, "size": f.stat().st_size,
                        "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in files]
            return self._send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
        f = folder / m.group(4)
        if not f.is_file():
            return self._send(h, 404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, head)
        data = f.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        return self._send(h, 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"',
                                         "Content-Type": "application/octet-stream"}, head)


class SilentHub:
    """An endpoint that accepts every connection and never sends a byte (a hung server or proxy)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.conns.append(conn)

    def __enter__(self) -> SilentHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)
        for c in self.conns:
            c.close()


class RawHub:
    """An endpoint that answers every connection with `reply(conn)` on a loopback socket, for replies no HTTP
    server library sends: a response trickled a byte at a time, garbage instead of HTTP. It stops by itself:
    no connection is served longer than `limit_s`, and leaving the `with` ends every connection."""

    def __init__(self, mode: str, every_s: float = 0.5, limit_s: float = 60.0) -> None:
        self.mode, self.every_s, self.limit_s = mode, every_s, limit_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                conn.recv(65536)  # the request (its first packet is enough for these replies)
                if self.mode == "garbage":
                    conn.sendall(b"\x16\x03\x01 this is no HTTP server \xff\xfe\r\n\r\n")
                    return
                if self.mode == "trickle-headers":
                    data = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 100000
                else:  # trickle-body: headers at once, then the body a byte at a time
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 100000\r\n\r\n")
                    data = b" " * 100000
                deadline = time.monotonic() + self.limit_s
                for i in range(len(data)):
                    if self.stop.wait(self.every_s) or time.monotonic() > deadline:
                        return
                    conn.sendall(data[i:i + 1])
            except OSError:  # the client gave up
                return

    def __enter__(self) -> RawHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5)
