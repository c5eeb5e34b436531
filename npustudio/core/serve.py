"""An OpenAI-compatible HTTP endpoint over any runner the chat panel has (`npustudio serve`): the phone or virtual
device, this computer's Genie, the CPU preview, MNN.

Built on aiohttp's server (already in NPU Studio's dependency tree through Ray, kept up by the aio-libs team): its
parser, body limit and streamed responses, so no HTTP is parsed here. What a request asks that the runner cannot do
exactly (another temperature than the bundle's sampler, several choices, penalties, tools, log-probabilities) is
refused with a 400 naming the field; `max_tokens` and `stop` are honoured here, on the answer's tokens and text.
One answer runs at a time (the runners are single-stream); up to `max_waiting` wait their turn, later ones get a
429. A client that goes away stops its answer, the runner's process included.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from . import layout
from .chat import ChatModel, Engine, clean_answer
from .errors import UserError
from .fsutil import MiB, TooLarge, read_at_most
from .genie.adapters import Choice
from .genie.config import PROMPT_LIMIT, chat_prompt, check_prompt
from .progress import StateLike

LOOPBACK = ("127.0.0.1", "::1", "localhost")
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>")  # printed by some runners before they stop
BODY_LIMIT = PROMPT_LIMIT + 256 * 1024  # a prompt at the runners' limit, and the JSON around it


class RequestError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> web.Response:
        return _error(self.status, self.message, self.param, self.code, self.kind)


@dataclass
class Sampling:
    """How the runner picks tokens, fixed when its bundle was made: greedy, or Genie's sampler's values."""

    greedy: bool
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def check(self, body: dict[str, Any]) -> None:
        """A 400 for a sampler field the runner would not honour (absent fields take the runner's own)."""
        fix = ("This model's sampler is fixed when its bundle is made; leave the field out, or rebuild the bundle "
               "with the sampling you want (`npustudio bundle --sample` for top-k/top-p sampling).")
        asked: dict[str, float] = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed")
                                   if body.get(k) is not None}
        for k, v in asked.items():
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise RequestError(400, f"'{k}' must be a number.", k, "invalid_type")
        if self.greedy:
            if asked.get("temperature", 0) != 0:
                raise RequestError(400, f"This model answers greedily (the likeliest token every time): temperature "
                                        f"{asked['temperature']} cannot be honoured; send temperature 0. {fix}",
                                   "temperature", "unsupported_value")
            if asked.get("top_p", 1) != 1 or asked.get("top_k", 1) != 1:
                key = "top_p" if asked.get("top_p", 1) != 1 else "top_k"
                raise RequestError(400, f"This model answers greedily: {key} {asked[key]} cannot be honoured. {fix}",
                                   key, "unsupported_value")
            return  # a seed changes nothing in a greedy answer
        own = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        for k, v in asked.items():
            mine = own[k]
            if mine is None:
                raise RequestError(400, f"This model's sampler has no {k} setting: {k} {v} cannot be honoured. {fix}",
                                   k, "unsupported_value")
            if abs(float(v) - float(mine)) > 1e-6:
                raise RequestError(400, f"This model samples with {k} {own[k]}: {k} {v} cannot be honoured. {fix}",
                                   k, "unsupported_value")


REFUSED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {  # the field, when it is harmless, and why not else
    "n": (lambda v: v in (None, 1), "one answer per request (n = 1)"),
    "best_of": (lambda v: v in (None, 1), "one answer per request"),
    "presence_penalty": (lambda v: v in (None, 0), "no presence penalty"),
    "frequency_penalty": (lambda v: v in (None, 0), "no frequency penalty"),
    "repetition_penalty": (lambda v: v in (None, 1), "no repetition penalty"),
    "logit_bias": (lambda v: not v, "no logit bias"),
    "logprobs": (lambda v: v in (None, False, 0), "no log-probabilities"),
    "top_logprobs": (lambda v: v in (None, 0), "no log-probabilities"),
    "tools": (lambda v: not v, "no tool calls"),
    "functions": (lambda v: not v, "no function calls"),
    "tool_choice": (lambda v: v in (None, "none"), "no tool calls"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "plain text answers only (no JSON mode)"),
    "echo": (lambda v: v in (None, False), "no echo of the prompt"),
    "suffix": (lambda v: v in (None, ""), "no suffix (insertion)"),
}


@dataclass
class Answer:
    text: str = ""
    finish_reason: str = "stop"
    completion_tokens: int = 0


@dataclass
class _Limits:
    """`max_tokens` and `stop`, applied to the answer as it streams: what may be shown so far, and when to stop."""

    tok: Any
    max_tokens: int | None
    stops: list[str]
    text: str = ""
    shown: int = 0
    done: str | None = None  # the finish reason once a limit is reached
    count: int | None = None  # the answer's tokens when `max_tokens` cut it
    native: int | None = None  # max_tokens, when the runner stops itself after that many
    hidden: tuple[str, ...] = field(default=END_MARKERS)

    def add(self, piece: str) -> str:
        """The text that may be shown now (held back while it could be the start of a stop sequence)."""
        if self.done:
            return ""
        self.text += piece
        cut = min((i for s in (*self.stops, *self.hidden) if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.text, self.done = self.text[:cut], "stop"
        if self.max_tokens is not None and len(self.text) >= self.max_tokens:  # a token is at least one character
            ids = self.tok(self.text, add_special_tokens=False)["input_ids"]
            if len(ids) >= self.max_tokens:
                self.text, self.done = self.tok.decode(ids[:self.max_tokens]), "length"
                self.count = self.max_tokens
        hold = 0 if self.done else _partial(self.text, (*self.stops, *self.hidden))
        upto = max(self.shown, len(self.text) - hold)
        out, self.shown = self.text[self.shown:upto], upto
        return out

    def rest(self) -> str:
        out, self.shown = self.text[self.shown:], len(self.text)
        return out


class Server:
    """The endpoint for one model over one runner. `api_key`: required as a Bearer token when set (always when the
    server listens beyond loopback)."""

    def __init__(self, engine: Engine, model: ChatModel, model_id: str, sampling: Sampling,
                 api_key: str | None = None, max_waiting: int = 16) -> None:
        self.engine, self.model, self.model_id, self.sampling = engine, model, model_id, sampling
        self.api_key, self.max_waiting = api_key, max_waiting
        self.created = int(time.time())
        self._turn = asyncio.Lock()
        self._waiting = 0
        self.answering = threading.Event()  # set while the runner answers (tests and the window watch it)
        self._stops: set[threading.Event] = set()  # the answer running now: set when the server shuts down

    def stop_all(self) -> None:
        """Stop the answer in progress (the server is shutting down)."""
        for stop in list(self._stops):
            stop.set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=BODY_LIMIT, middlewares=[self._errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.one_model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """Every refusal as OpenAI's error JSON: the client libraries show its message."""
        try:
            if self.api_key is not None:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    raise RequestError(401, "Missing or wrong API key: send 'Authorization: Bearer KEY' with the key "
                                            "the server was started with.", code="invalid_api_key",
                                       kind="authentication_error")
            response: web.StreamResponse = await handler(request)
            return response
        except RequestError as e:
            return e.response()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"The request body is over {BODY_LIMIT:,} bytes: the prompt is too long for any "
                               "model this server runs.", code="request_too_large")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(e.status, f"{e.reason}: {request.method} {request.path} is not an endpoint of this server "
                                    "(it has /v1/models, /v1/chat/completions, /v1/completions).",
                          code="not_found" if e.status == 404 else None)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def one_model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "npustudio"}

    def _check_model(self, name: Any) -> None:
        if name != self.model_id:
            raise RequestError(404, f"The model {name!r} does not exist here: this server runs {self.model_id!r}.",
                               "model", "model_not_found")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"The request body is not valid JSON ({e}).", code="invalid_json") from e
        if not isinstance(body, dict):
            raise RequestError(400, "The request body must be a JSON object.", code="invalid_json")
        self._check_model(body.get("model"))
        for key, (ok, said) in REFUSED_FIELDS.items():
            if not ok(body.get(key)):
                raise RequestError(400, f"'{key}' cannot be honoured: this server gives {said}.", key,
                                   "unsupported_parameter")
        self.sampling.check(body)
        return body

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = self._chat_prompt(body.get("messages"))
        return await self._answer(request, body, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "'prompt' must be one non-empty string.", "prompt", "invalid_type")
        if self.engine.one_question:
            raise RequestError(400, f"{self.engine.name} applies the chat template itself: it answers chat messages "
                                    "only.", "prompt", "unsupported_endpoint")
        return await self._answer(request, body, prompt, chat=False)

    def _chat_prompt(self, messages: Any) -> str:
        """The model's chat template over the messages, as the chat panel renders it; refused rather than cut when
        it does not fit the context."""
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list.", "messages", "invalid_type")
        system, turns = None, []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
                raise RequestError(400, f"messages[{i}] must have a role of system, developer, user or assistant "
                                        "(tool messages are not supported).", f"messages[{i}].role", "invalid_role")
            text = _text(m.get("content"), i)
            if m["role"] in ("system", "developer"):
                if i != 0:
                    raise RequestError(400, f"messages[{i}]: a system message may only come first.",
                                       f"messages[{i}].role", "invalid_role")
                system = text
            else:
                turns.append((m["role"], text))
        expected = ["user", "assistant"] * len(turns)
        if [r for r, _ in turns] != expected[:len(turns)] or not turns or turns[-1][0] != "user":
            raise RequestError(400, "The messages must alternate user and assistant (after an optional system "
                                    "message) and end with the user's.", "messages", "invalid_order")
        if self.engine.one_question and (system or len(turns) > 1):
            raise RequestError(400, f"{self.engine.name} answers one question on its own: send a single user message "
                                    "(no system message, no earlier turns).", "messages", "unsupported_value")
        try:
            for _, t in turns:
                check_prompt(t)
            if self.engine.one_question:
                return turns[-1][1]
            history = [{"role": r, "content": t} for r, t in turns[:-1]]
            return chat_prompt(self.model.tok, turns[-1][1], system, history)
        except UserError as e:
            raise RequestError(400, f"{e.problem} {e.fix}", "messages", "invalid_value") from e

    async def _answer(self, request: web.Request, body: dict[str, Any], prompt: str, chat: bool) -> web.StreamResponse:
        try:
            check_prompt(prompt)
        except UserError as e:
            raise RequestError(400, f"{e.problem} {e.fix}", "prompt", "invalid_value") from e
        prompt_tokens = len(self.model.tok(prompt, add_special_tokens=False)["input_ids"]) + 1  # + Genie's BOS
        if prompt_tokens > self.model.limit:
            raise RequestError(400, f"The prompt is {prompt_tokens} tokens; this model takes at most "
                                    f"{self.model.limit} (its context, less room for the answer). Send fewer or "
                                    "shorter messages.", "messages" if chat else "prompt", "context_length_exceeded")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise RequestError(400, "'max_tokens' must be a whole number of at least 1.", "max_tokens",
                               "invalid_value")
        stops = body.get("stop")
        stops = [stops] if isinstance(stops, str) else stops if stops is not None else []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings.", "stop",
                               "invalid_value")
        stream = body.get("stream") is True
        include_usage = stream and isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage"))
        if self._waiting >= self.max_waiting:
            raise RequestError(429, f"The server is busy: {self._waiting} requests are waiting for the model, which "
                                    "answers one at a time. Try again shortly.", code="rate_limit_exceeded",
                               kind="rate_limit_error")
        # a runner that stops itself after max_tokens counts the tokens it made, shown or not (a random model's
        # special tokens print nothing); otherwise the answer's text is counted in tokens here
        native = max_tokens if self.engine.exact_max_tokens else None
        limits = _Limits(self.model.tok, None if native else max_tokens, stops, native=native)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self._waiting += 1
        try:
            await self._turn.acquire()
        finally:
            self._waiting -= 1
        try:
            if stream:
                return await self._streamed(request, prompt, limits, ident, chat, prompt_tokens, include_usage)
            answer = Answer()
            async with aclosing(self._run(request, prompt, limits, answer)) as pieces:
                async for _piece in pieces:
                    pass
            return web.json_response(_whole(ident, self.model_id, chat, answer, prompt_tokens))
        finally:
            self._turn.release()

    async def _streamed(self, request: web.Request, prompt: str, limits: _Limits, ident: str, chat: bool,
                        prompt_tokens: int, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())

        def chunk(delta: dict[str, Any] | str, finish: str | None = None) -> bytes:
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            data = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": self.model_id, "choices": [choice]}
            return f"data: {json.dumps(data)}\n\n".encode()

        answer = Answer()
        try:
            if chat:
                await resp.write(chunk({"role": "assistant", "content": ""}))
            async with aclosing(self._run(request, prompt, limits, answer)) as pieces:
                async for piece in pieces:
                    await resp.write(chunk({"content": piece} if chat else piece))
            await resp.write(chunk({} if chat else "", answer.finish_reason))
            if include_usage:
                usage: dict[str, Any] = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": self.model_id, "choices": [],
                         "usage": _usage(prompt_tokens, answer.completion_tokens)}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        except RequestError as e:  # the runner failed after the stream began: said in the stream, as OpenAI does
            await resp.write(f"data: {json.dumps({'error': _error_fields(e.message, e.code, e.param, e.kind)})}\n\n"
                             .encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _run(self, request: web.Request, prompt: str, limits: _Limits,
                   answer: Answer) -> AsyncGenerator[str, None]:
        """The runner's answer in a worker thread, its text yielded as it may be shown; stopped when a limit is
        reached or the client goes away (checked every 0.1 s, and on every write)."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        stop = threading.Event()
        outcome: dict[str, Any] = {}

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        def work() -> None:
            self.answering.set()
            try:
                outcome["result"] = self.engine.ask(prompt, on_text, stop, max_tokens=limits.native)
            except UserError as e:
                outcome["error"] = e
            except Exception as e:  # the runner's own fault: said to the client, the server stays up
                outcome["error"] = UserError(f"The runner failed: {type(e).__name__}: {e}", "Try again; if it goes "
                                             "on failing, check the device or the model.")
            finally:
                self.answering.clear()
                loop.call_soon_threadsafe(pieces.put_nowait, None)

        worker = loop.run_in_executor(None, work)
        self._stops.add(stop)
        try:
            while True:
                try:
                    piece = await asyncio.wait_for(pieces.get(), timeout=0.1)
                except TimeoutError:
                    if request.transport is None or request.transport.is_closing():
                        stop.set()  # the client went away: the runner (and a device's process) stops
                    continue
                if piece is None:
                    break
                shown = limits.add(piece)
                if limits.done:
                    stop.set()
                if shown:
                    yield shown
        finally:  # closed early (a limit, a write to a client that went away): the runner stops, then is awaited
            if not worker.done():
                stop.set()
            await asyncio.shield(worker)
            self._stops.discard(stop)
        if "error" in outcome and not limits.done:
            e = outcome["error"]
            raise RequestError(500 if "runner failed" in e.problem else 400, f"{e.problem} {e.fix}",
                               code="runner_error", kind="server_error")
        rest = limits.rest()
        if rest:
            yield rest
        answer.text = clean_answer(limits.text, self.model.tok) if not limits.done else limits.text
        made = _generated_tokens(outcome.get("result"))  # Genie's (or the preview's) own count
        counted = len(self.model.tok(answer.text, add_special_tokens=False)["input_ids"])
        answer.completion_tokens = (limits.count if limits.count is not None else counted
                                    if limits.done or made is None else made)
        at_limit = limits.native is not None and answer.completion_tokens >= limits.native
        answer.finish_reason = limits.done or ("length" if at_limit else "stop")


def _partial(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin a stop sequence (held back until it is known)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def _text(content: Any, i: int) -> str:
    """A message's text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"messages[{i}].content: only text parts are supported (this model reads no "
                                    "images or audio).", f"messages[{i}].content", "unsupported_content")
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts.",
                       f"messages[{i}].content", "invalid_type")


def _generated_tokens(result: Any) -> int | None:
    """The tokens Genie says it generated (its profile), when the runner gives one."""
    from .genie import profile

    if not result or not result[2]:
        return None
    try:
        n = profile.summarize(profile.parse(result[2])).generated_tokens
    except (UserError, ValueError, KeyError, TypeError):
        return None
    return int(n) if n is not None else None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _whole(ident: str, model_id: str, chat: bool, a: Answer, prompt_tokens: int) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": a.text},
                                  "finish_reason": a.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": a.text, "finish_reason": a.finish_reason, "logprobs": None}
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [choice], "usage": _usage(prompt_tokens, a.completion_tokens)}


def _error_fields(message: str, code: str | None, param: str | None, kind: str) -> dict[str, Any]:
    return {"message": message, "type": kind, "param": param, "code": code}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": _error_fields(message, code, param, kind)}, status=status)


def check_address(host: str, api_key: str | None) -> None:
    """Loopback by default; another address only with an API key, since anyone who reaches it uses the model."""
    if host not in LOOPBACK and not api_key:
        raise UserError(f"Serving on {host} would let anyone who reaches this computer use the model.",
                        "Set NPUSTUDIO_API_KEY to a secret the clients send as their API key, or serve on "
                        "127.0.0.1 (the default).")


async def serve(server: Server, host: str, port: int, ready: Callable[[str], None],
                stopped: asyncio.Event | None = None) -> None:
    """Listen until `stopped` is set (or the task is cancelled); `ready` gets the base URL once bound."""
    runner = web.AppRunner(server.app(), access_log=None, keepalive_timeout=30)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        bound = sockets[0].getsockname()[1] if sockets else port
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{bound}/v1")
        await (stopped or asyncio.Event()).wait()
    finally:
        server.stop_all()
        await runner.cleanup()


def sampling_of(folder: Path, preview: bool = False) -> Sampling:
    """The runner's sampler, as its bundle (or MNN's config.json) fixed it; the CPU preview is greedy."""
    from .chat import mnn_samples_greedily, samples_greedily

    if (folder / layout.MNN_RESULT).is_file():
        if mnn_samples_greedily(folder):
            return Sampling(greedy=True)
        cfg = _json(folder / layout.MNN_MODEL / layout.MNN_CONFIG)
        return Sampling(False, cfg.get("temperature"), cfg.get("topP"), cfg.get("topK"))
    if samples_greedily(folder, preview):
        return Sampling(greedy=True)
    sampler = _json(folder / layout.GENIE_CONFIG).get("dialog", {}).get("sampler", {})
    return Sampling(False, sampler.get("temp"), sampler.get("top-p"), sampler.get("top-k"), sampler.get("seed"))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_at_most(path, MiB))
    except (OSError, ValueError, TooLarge) as e:
        raise UserError(f"{path} cannot be read ({e}).", "Make the bundle again.") from e
    return data if isinstance(data, dict) else {}


class Background:
    """The server on a thread of its own with its own event loop, for a caller that must not block (the window):
    `start` returns the URL once it listens, `stop` ends it and the answer in progress."""

    def __init__(self, server: Server, host: str, port: int) -> None:
        self.server, self.host, self.port = server, host, port
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="openai-server", daemon=True)

    def start(self, timeout: float = 30) -> str:
        """The base URL, once listening; a UserError when it cannot listen (the port taken, a bad address)."""
        self._thread.start()
        if not self._bound.wait(timeout) or self.url is None:
            self.stop()
            e = self._error
            raise UserError(f"The server could not listen on {self.host}:{self.port}"
                            + (f": {getattr(e, 'strerror', None) or e}." if e else "."),
                            "Pick another port, or stop what uses that one.")
        return self.url

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._stopped is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stopped.set)
            except RuntimeError:  # its loop has just ended
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.url is not None

    def _run(self) -> None:
        async def main() -> None:
            self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()

            def ready(url: str) -> None:
                self.url = url
                self._bound.set()

            await serve(self.server, self.host, self.port, ready, self._stopped)

        try:
            asyncio.run(main())
        except BaseException as e:  # reported by `start`: the caller's thread says it
            self._error = e
        finally:
            self._bound.set()


def model_id_of(folder: Path) -> str:
    """The model's name to clients: its project's folder name (a project's bundle), else the folder's."""
    b = Path(folder).resolve()
    return b.parents[1].name if b.parent.name == layout.STAGES_DIR else b.name


def open_server(bundle: Path, where: Literal["device", "desktop", "preview", "mnn"], serial: str | None = None,
                state: StateLike | None = None, api_key: str | None = None, max_waiting: int = 16,
                lora: Choice | None = None) -> Server:
    """The endpoint over the runner the chat would use for `bundle` (a device gets the bundle first), answering
    with its switchable LoRA adapter `lora` where given."""
    from . import pipeline
    from .chat import chat_model

    engine = pipeline.open_engine(bundle, where, serial, state, apart=True, lora=lora)
    return Server(engine, chat_model(bundle), model_id_of(bundle), sampling_of(bundle, where == "preview"),
                  api_key=api_key, max_waiting=max_waiting)
