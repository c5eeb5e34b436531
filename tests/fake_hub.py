"""A loopback Hugging Face hub: the endpoints `snapshot_download` uses, served from a local folder.

Set HF_ENDPOINT to its URL. Repos listed in `gated` answer 401/403 with X-Error-Code GatedRepo unless the
request carries the accepted token, as the real hub does. `SilentHub` accepts connections and never answers.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path], gated: dict[str, str] | None = None) -> None:
        self.repos = repos
        self.gated = gated or {}  # repo -> token that has access
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
