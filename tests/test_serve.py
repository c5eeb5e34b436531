"""`npustudio serve`: the OpenAI-compatible endpoint, run as a user runs it (the console script as a process) and
talked to by the official `openai` client and by raw sockets; on loopback only."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import APIStatusError, OpenAI

from npustudio.core import device
from npustudio.core.device.virtual import VirtualDevice
from npustudio.core.project import Project
from tests.conftest import NPUSTUDIO, npustudio, wait_until

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def bundle(genie_project: Project) -> Path:
    return genie_project.stage_dir("bundle")


@contextlib.contextmanager
def served(*flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`npustudio serve FLAGS --port 0` until the block ends (SIGTERM, as a service manager stops it); yields its
    base URL, read from what it prints."""
    proc = subprocess.Popen([NPUSTUDIO, "serve", "--port", "0", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert proc.stderr is not None
    said: list[str] = []
    url = None
    deadline = time.monotonic() + 300
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"serve ended before it listened: {''.join(said)[-3000:]}")
        said.append(line)
        if m := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line):
            url = m.group(1)
    assert url is not None, "".join(said)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe from filling
    try:
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, 130)


def _client(url: str, key: str = "none") -> OpenAI:
    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)


def _streamed(client: OpenAI, model: str, messages: list[dict[str, str]], **kw: Any) -> tuple[str, str, Any]:
    text, finish, usage = "", "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,  # type: ignore[call-overload]
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


def _raw(url: str, body: bytes, path: str = "/chat/completions", headers: str = "") -> tuple[int, dict[str, Any]]:
    """One request on a socket of its own; (status, JSON body)."""
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()  # type: ignore[union-attr]
    with socket.create_connection((host, int(port)), timeout=300) as s:
        s.sendall(f"POST /v1{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload) if payload.strip() else {}


def _read_until(s: socket.socket, marker: bytes) -> None:
    seen = b""
    while marker not in seen:
        chunk = s.recv(4096)
        assert chunk, seen
        seen += chunk


def test_the_openai_client_gets_the_chat_panels_answer_streamed_and_whole_from_the_cpu_preview(bundle: Path) -> None:
    """The official client, streamed and not: the same greedy answer as `npustudio chat --preview` gives for the
    same message (the chat template applied as the chat panel applies it), usage counted, max_tokens and stop
    honoured on the answer's tokens and text; /v1/completions takes a raw prompt; /v1/models names the project."""
    chat = npustudio("chat", "--bundle", str(bundle), "--preview", "--new", QUESTION, timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    with served("--bundle", str(bundle), "--preview") as (url, _proc):
        client = _client(url)
        model = client.models.list().data[0].id
        assert model == bundle.parents[1].name
        msgs = [{"role": "user", "content": QUESTION}]
        text, finish, usage = _streamed(client, model, msgs)
        whole = client.chat.completions.create(model=model, messages=msgs)  # type: ignore[arg-type]
        assert text.strip() == chat.stdout.strip() == (whole.choices[0].message.content or "").strip() != ""
        assert finish == whole.choices[0].finish_reason == "stop"
        assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens > 10  # type: ignore[union-attr]
        assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

        cut, finish, usage = _streamed(client, model, msgs, max_tokens=3)
        assert finish == "length" and usage.completion_tokens == 3 and text.startswith(cut), (cut, text)
        stop = text.strip()[2:4]
        stopped, finish, _ = _streamed(client, model, msgs, stop=[stop])
        assert finish == "stop" and stopped == text[:text.index(stop)], (stopped, stop, text)

        raw = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
        assert raw.choices[0].finish_reason == "length" and raw.usage.completion_tokens == 4  # type: ignore[union-attr]


def test_bad_requests_get_clear_http_errors_and_the_server_stays_up(bundle: Path) -> None:
    """Malformed JSON, an unknown model, a 10 MB prompt, fields the runner cannot honour, a bad message order,
    50 requests at once, a client that vanishes mid-answer and a slow-loris client: each gets its HTTP error (or
    its answer), and the server answers the next request."""
    with served("--bundle", str(bundle), "--preview", "--max-waiting", "4") as (url, proc):
        model = bundle.parents[1].name
        ok = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
        cases = [(b"{not json", 400, "not valid JSON"),
                 (b"[1, 2]", 400, "must be a JSON object"),
                 (json.dumps({"model": "gpt-4o", "messages": []}).encode(), 404, "this server runs"),
                 (json.dumps({"model": model, "messages": [{"role": "user", "content": "a" * 10_000_000}]}).encode(),
                  413, "too long"),
                 (ok[:-1] + b', "temperature": 0.8}', 400, "answers greedily"),
                 (ok[:-1] + b', "n": 3}', 400, "'n' cannot be honoured"),
                 (ok[:-1] + b', "tools": [{"type": "function"}]}', 400, "no tool calls"),
                 (json.dumps({"model": model, "messages": [{"role": "assistant", "content": "x"}]}).encode(), 400,
                  "must alternate user and assistant"),
                 (json.dumps({"model": model, "messages": [{"role": "user", "content": [
                     {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "only text parts"),
                 (json.dumps({"model": model, "messages": [{"role": "user", "content": "word " * 5000}]}).encode(),
                  400, "this model takes at most")]
        for body, status, said in cases:
            got, answer = _raw(url, body)
            assert got == status and said in answer["error"]["message"], (body[:80], got, answer)
        with pytest.raises(APIStatusError) as e:
            _client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 temperature=1.5)
        assert e.value.status_code == 400 and "temperature 1.5 cannot be honoured" in e.value.message

        # 50 at once: one answers, four wait their turn, the rest are told the server is busy
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(_raw(url, ok)[0])) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert len(results) == 50 and set(results) <= {200, 429} and results.count(200) >= 5, results

        # a client gone mid-answer: its answer stops, the next request is served
        host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()  # type: ignore[union-attr]
        long = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "Tell a long "
                                                                          "story."}]}).encode()
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(long)}\r\n\r\n".encode()
                  + long)
        _read_until(s, b"data:")
        s.close()
        # a slow-loris client holds a half-sent request open; others are answered meanwhile
        loris = socket.create_connection((host, int(port)), timeout=60)
        loris.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.monotonic()
        assert _raw(url, ok)[0] == 200
        assert time.monotonic() - t0 < 120
        loris.close()
        assert proc.poll() is None


def test_an_api_key_is_required_beyond_loopback_and_checked_when_set(bundle: Path) -> None:
    """Listening on another address without NPUSTUDIO_API_KEY is refused before anything listens; with a key
    set, a request without it (or with another) gets a 401 and one with it the answer."""
    res = npustudio("serve", "--bundle", str(bundle), "--preview", "--host", "0.0.0.0", timeout=120,
                    env={"NPUSTUDIO_API_KEY": ""})
    assert res.returncode == 2 and "Set NPUSTUDIO_API_KEY" in res.stderr, res.stderr[-1500:]
    with served("--bundle", str(bundle), "--preview", env={"NPUSTUDIO_API_KEY": "s3cret"}) as (url, _proc):
        model = bundle.parents[1].name
        for key in ("none", "s3cre"):
            with pytest.raises(APIStatusError) as e:
                _client(url, key).models.list()
            assert e.value.status_code == 401
        assert _client(url, "s3cret").models.list().data[0].id == model


def test_the_openai_client_streams_from_the_virtual_device_and_a_vanished_client_ends_its_process(
        bundle: Path, adb_server: list[str], tmp_path: Path) -> None:
    """The bundle deployed to the virtual device through the real adb server and answered by Genie there,
    streamed to the official client; a client that vanishes mid-answer leaves no genie-t2t-run on the device."""
    vd = VirtualDevice(tmp_path / "phone").start()
    try:
        assert "connected" in str(device.client().connect(vd.serial, timeout=15))
        with served("--bundle", str(bundle), "--device", vd.serial) as (url, _proc):
            client = _client(url)
            model = client.models.list().data[0].id
            text, finish, usage = _streamed(client, model, [{"role": "user", "content": QUESTION}], max_tokens=6)
            assert text and finish == "length" and usage.completion_tokens == 6, (text, finish, usage)
            host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()  # type: ignore[union-attr]
            body = json.dumps({"model": model, "stream": True,
                               "messages": [{"role": "user", "content": "Tell a long story."}]}).encode()
            s = socket.create_connection((host, int(port)), timeout=120)
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                      .encode() + body)
            _read_until(s, b"data:")
            wait_until(lambda: bool(vd.processes), 60)
            s.close()
            wait_until(lambda: not any(p.poll() is None for p in vd.processes.values()), 60)
            assert _streamed(client, model, [{"role": "user", "content": "hi"}], max_tokens=2)[1] == "length"
    finally:
        device.client().disconnect(vd.serial)
        vd.stop()
