"""`autodeploy serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one optimized model.

Endpoints: `GET /v1/models`, `POST /v1/completions` (prompt as text or token ids, one or several),
`POST /v1/chat/completions` (the tokenizer's chat template), both streaming (SSE) or not;
`GET /health`; `GET /metrics` (Prometheus). Requests join the running batch between engine steps
(`engine_loop.EngineLoop`). A client that disconnects is cancelled and its pages come back; a
request the server cannot take (malformed JSON, unknown model, bad parameters, a prompt that cannot
fit) gets a 4xx with an OpenAI-style error body before it reaches the engine, and disturbs no other
request. On shutdown the server stops taking requests, lets running ones finish for a while, then
cancels the rest.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from ..api import OptimizedModel
from ..runtime.errors import CapacityError, RequestError
from ..runtime.sampling import SamplingParams
from .engine_loop import EngineLoop, RequestHandle
from .protocol import ChatCompletionRequest, CompletionRequest, error_body

DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


# ----------------------------------------------------------------------------- detokenization
@dataclass
class TextStream:
    """Incremental text of one choice: decodes the generated ids, holds back an incomplete UTF-8
    character and any suffix that may begin a stop string, and cuts the text at the first stop."""

    tokenizer: Any
    stops: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stops:
            cut = text.find(s)
            if cut >= 0:
                self.stopped = True
                text = text[:cut]
                break
        else:
            if text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
                text = text[:-1]
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        if not text.startswith(self.emitted):  # decoding changed earlier text (merged characters)
            text = self.emitted
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def finish(self) -> str:
        """The rest of the text once the choice is over (what was held back, if no stop was seen)."""
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta


# ----------------------------------------------------------------------------- one HTTP request's choices
@dataclass
class Choice:
    handle: RequestHandle
    text: TextStream
    finish_reason: Optional[str] = None
    generated: list[int] = field(default_factory=list)


def _finish_reason(choice: Choice, reason: Optional[str]) -> str:
    if choice.text.stopped:
        return "stop"
    return {"length": "length", "stop": "stop"}.get(reason or "", "stop")


def _failed(choice: Choice, r: Any) -> Optional[str]:
    """Why a finished request did not end normally (None if it did): an engine error, or a
    cancellation the server did not ask for through a stop string."""
    if r.finish_reason == "error" or (r.finish_reason == "cancelled" and not choice.text.stopped):
        return r.error or r.finish_reason
    return None


class Server:
    def __init__(self, om: OptimizedModel, tokenizer: Any = None, model_name: str = "model",
                 drain_timeout_s: float = 10.0) -> None:
        self.om = om
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.drain_timeout_s = drain_timeout_s
        self.engine = EngineLoop(om)
        self.created = int(time.time())

    # -- request parsing
    async def _parse(self, request: Request, schema: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"{loc + ': ' if loc else ''}{err['msg']}", param=loc) from None
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if req.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer, and this model has none; use stop_token_ids",
                           param="stop")
        return req

    def _encode(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for p in prompts:
            try:
                self.engine.validate(p, params)
            except (RequestError, CapacityError) as exc:
                param = "max_tokens" if "max_new_tokens" in str(exc) else "prompt"
                raise APIError(400, str(exc), param=param) from None

    def _submit(self, prompts: list[list[int]], params: SamplingParams, stops: Sequence[str]) -> list[Choice]:
        if not self.engine.alive:
            raise APIError(503, "the engine is not running", kind="server_error")
        events: asyncio.Queue = asyncio.Queue()
        try:
            return [Choice(self.engine.submit(p, params, events, i), TextStream(self.tokenizer, stops))
                    for i, p in enumerate(prompts)]
        except RuntimeError as exc:  # shutting down
            raise APIError(503, str(exc), kind="server_error") from None

    async def _events(self, request: Request, choices: list[Choice]) -> AsyncIterator[tuple[int, str, Any]]:
        """The choices' events until all are finished; cancels them if the client goes away."""
        events = choices[0].handle.events
        open_ = {c.handle.index for c in choices}
        try:
            while open_:
                try:
                    ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if ev[1] in ("finish", "error"):
                    open_.discard(ev[0])
                yield ev
        finally:
            for c in choices:  # the client left, or we stopped early: give the pages back
                if c.finish_reason is None:
                    self.engine.cancel(c.handle)

    def _on_token(self, c: Choice, tok: int) -> str:
        c.generated.append(tok)
        delta = c.text.add(tok)
        if c.text.stopped:
            self.engine.cancel(c.handle)
        return delta

    # -- responses
    def _usage(self, choices: list[Choice]) -> dict[str, int]:
        p = sum(len(c.handle.prompt) for c in choices)
        g = sum(len(c.generated) for c in choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    async def completion(self, request: Request, chat: bool) -> Response:
        req = await self._parse(request, ChatCompletionRequest if chat else CompletionRequest)
        if chat:
            prompts = [self._chat_prompt(req)]
            max_tokens = req.max_tokens or req.max_completion_tokens or max(
                1, self.om.seq_info.max_seq_len - len(prompts[0]))
        else:
            prompts = [self._encode(p) for p in req.prompts()]
            max_tokens = req.max_tokens or req.max_completion_tokens or 16
        try:
            params = req.sampling(max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        self._validate(prompts, params)
        choices = self._submit(prompts, params, req.stop or ())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._stream(request, req, choices, rid, chat), media_type="text/event-stream")
        async for index, kind, value in self._events(request, choices):
            c = choices[index]
            if kind == "token":
                self._on_token(c, value)
            elif kind == "error":
                raise APIError(500, f"generation failed: {value}", kind="server_error")
            elif kind == "finish":
                if (why := _failed(c, value)) is not None:
                    raise APIError(500, f"generation failed: {why}", kind="server_error")
                c.text.finish()
                c.finish_reason = _finish_reason(c, value.finish_reason)
        if any(c.finish_reason is None for c in choices):  # client gone
            return Response(status_code=499)
        out_choices = []
        for i, c in enumerate(choices):
            item: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason, "logprobs": None}
            if chat:
                item["message"] = {"role": "assistant", "content": c.text.emitted}
            else:
                item["text"] = c.text.emitted
            if req.return_token_ids:
                item["prompt_token_ids"] = c.handle.prompt
                item["token_ids"] = c.generated
            out_choices.append(item)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": out_choices,
                             "usage": self._usage(choices)})

    async def _stream(self, request: Request, req: Any, choices: list[Choice], rid: str, chat: bool
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: Optional[str], finish: Optional[str] = None, ids: Optional[list[int]] = None,
                  first: bool = False) -> str:
            item: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                item["delta"] = delta
            else:
                item["text"] = text or ""
            if req.return_token_ids:
                if first:
                    item["prompt_token_ids"] = choices[index].handle.prompt
                item["token_ids"] = ids or []
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [item]}
            if req.include_usage_in_stream:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        started = set()
        for c in choices:
            if chat or req.return_token_ids:
                yield chunk(c.handle.index, "" if chat else "", first=True)
                started.add(c.handle.index)
        async for index, kind, value in self._events(request, choices):
            c = choices[index]
            if kind == "token":
                delta = self._on_token(c, value)
                yield chunk(index, delta, ids=[value], first=index not in started)
                started.add(index)
            elif kind in ("finish", "error"):
                msg = value if kind == "error" else _failed(c, value)
                if msg is not None:
                    yield f"data: {json.dumps(error_body(f'generation failed: {msg}', 'server_error'))}\n\n"
                    c.finish_reason = "error"
                    continue
                rest = c.text.finish()
                c.finish_reason = _finish_reason(c, value.finish_reason)
                yield chunk(index, rest, finish=c.finish_reason)
        if any(c.finish_reason is None for c in choices):
            return  # client gone: nothing more to send
        if req.include_usage_in_stream:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                    "usage": self._usage(choices)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "chat completions need a tokenizer with a chat template; this model has none. "
                                "Use /v1/completions.", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    # -- the app
    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            if not self.engine.alive:
                self.engine.start()
            yield
            await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown, self.drain_timeout_s)

        app = FastAPI(title="autodeploy-mla", lifespan=lifespan)
        app.state.server = self

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                "owned_by": "autodeploy-mla",
                                                "max_model_len": self.om.seq_info.max_seq_len,
                                                "vocab_size": self.om.vocab_size}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completion(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.completion(request, chat=True)

        @app.get("/health")
        async def health() -> Response:
            if self.engine.alive:
                return JSONResponse({"status": "ok"})
            why = f"{type(self.engine.error).__name__}: {self.engine.error}" if self.engine.error else "not running"
            return JSONResponse({"status": "error", "error": why}, status_code=503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        return app


def create_app(om: OptimizedModel, tokenizer: Any = None, model_name: str = "model",
               drain_timeout_s: float = 10.0) -> FastAPI:
    """The FastAPI app serving `om` (the engine thread starts with the app's lifespan). Served by
    plain uvicorn, shutdown waits for running streams to end on their own; `UvicornServer` drains."""
    return Server(om, tokenizer, model_name, drain_timeout_s).app()


class UvicornServer(uvicorn.Server):
    """uvicorn for one `Server`, with a shutdown that drains: on Ctrl-C (or `should_exit`) it
    refuses new connections at once, gives running requests the server's drain timeout, then the
    engine cancels the rest and their streams end with an error event, so the connections close and
    uvicorn finishes (uvicorn alone would wait for every stream to run to its end)."""

    def __init__(self, server: Server, host: str, port: int, log_level: str = "info") -> None:
        self.serving = server
        super().__init__(uvicorn.Config(server.app(), host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=int(server.drain_timeout_s) + 30))

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        self.serving.engine.begin_shutdown(self.serving.drain_timeout_s)
        await super().shutdown(sockets)


class ServerThread:
    """Serve `om` from a background thread on a free local port (tests, benchmarks, notebooks):

        with ServerThread(om, tokenizer, "tiny") as url:
            OpenAI(base_url=f"{url}/v1", api_key="-").completions.create(...)

    Leaving the block shuts the server down (running requests get `drain_timeout_s`)."""

    def __init__(self, om: OptimizedModel, tokenizer: Any = None, model_name: str = "model",
                 drain_timeout_s: float = 10.0, host: str = "127.0.0.1", port: int = 0,
                 start_timeout_s: float = 60.0) -> None:
        self.server = Server(om, tokenizer, model_name, drain_timeout_s)
        self.host, self.port = host, port or _free_port(host)
        self._uvicorn = UvicornServer(self.server, host, self.port, log_level="warning")
        self._thread: Optional[threading.Thread] = None
        self._start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        self._thread = threading.Thread(target=self._uvicorn.run, name="autodeploy-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
