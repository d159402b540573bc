"""`autodeploy serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one model.

The model runs in an engine core of its own (serving/engine_core.py): by default a separate
process that builds the model from the config, so the GPU loop never shares a GIL with HTTP. This
process parses and validates requests, tokenizes, detokenizes and streams (SSE); it exchanges one
message per engine step with the core (serving/core_client.py).

Endpoints: `GET /v1/models`, `POST /v1/completions` (prompt as text or token ids, one or several;
`echo`, `logprobs`), `POST /v1/chat/completions` (the tokenizer's chat template; `logprobs`,
`top_logprobs`), streaming or not, `n` choices; `GET /health` (200 only once the model is built,
warmed up and its CUDA graphs captured; 503 while starting or after the engine failed);
`GET /metrics` (Prometheus). A client that disconnects is cancelled and its pages come back; a
request the server cannot take gets a 4xx with an OpenAI-style error body before it reaches the
engine, and disturbs no other. If the engine core dies, open requests end with an error, new ones
get 503, and the server exits with a non-zero code after `failure_grace_s`. On shutdown the server
stops taking requests, lets running ones finish for `drain_timeout_s`, then cancels the rest.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from .core_client import (FAILED, READY, STARTING, CoreHandle, EngineCoreClient, ProcessCore, RankedCores, RequestStream,
                          ThreadCore, data_parallel_configs)
from .detokenizer import TextStream
from .messages import Finished, Logprob, StepOutputs, TokenOut
from .metrics import ServingMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, _Request, error_body, validation_message

log = logging.getLogger("autodeploy.serve")
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


# ----------------------------------------------------------------------------- one choice
@dataclass
class Choice:
    index: int
    id: int  # the API request id of this choice
    prompt: list[int]
    text: TextStream
    generated: list[int] = field(default_factory=list)
    logprobs: list[Optional[Logprob]] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None
    finish_reason: Optional[str] = None
    failed: Optional[str] = None
    text_offset: int = 0  # characters of this choice's text handed out so far (logprobs text_offset)
    cached_tokens: int = 0  # prompt tokens the engine took from the prefix cache (with the first token)


def _finish_reason(c: Choice, f: Finished) -> tuple[Optional[str], Optional[str]]:
    """(finish_reason, error) for a choice whose request ended with `f`."""
    if c.text.stopped:
        return "stop", None
    if f.reason in ("length", "stop"):
        return f.reason, None
    return None, f.error or f.reason


# ----------------------------------------------------------------------------- the server
class Server:
    def __init__(self, core: CoreHandle, tokenizer: Any = None, model_name: str = "model",
                 drain_timeout_s: float = 10.0, failure_grace_s: float = 3.0,
                 on_progress: Optional[Callable[[str], None]] = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.drain_timeout_s = drain_timeout_s
        self.failure_grace_s = failure_grace_s
        self.metrics = ServingMetrics()
        self.client = EngineCoreClient(core, on_failure=self._core_failed, on_progress=on_progress or log.info)
        self.client.on_step = self._observe_step
        self.created = int(time.time())
        self.exit_code = 0
        #: called (from the event loop) when the server must stop on its own (engine failure)
        self.request_exit: Optional[Callable[[], None]] = None
        #: called with the model's `ModelInfo` once the engine core is ready
        self.on_ready: Optional[Callable[[Any], None]] = None
        self._timing: dict[int, list[float]] = {}  # choice id -> [arrival, first token, last token]
        self._prefix_seen = (0, 0)  # the engine's prefix-cache totals at the last step message
        self._token_text: dict[int, str] = {}

    # -- engine state
    def _core_failed(self, why: str) -> None:
        self.exit_code = 1
        if self.request_exit is not None:
            asyncio.get_running_loop().call_later(self.failure_grace_s, self.request_exit)

    def _require_ready(self) -> Any:
        c = self.client
        if c.state == READY and c.info is not None:
            return c.info
        if c.state == STARTING:
            raise APIError(503, f"the model is still starting ({c.progress}); retry when GET /health answers 200",
                           kind="server_error", code="starting")
        raise APIError(503, f"the engine is not running: {c.error or c.state}", kind="server_error",
                       code="engine_unavailable")

    async def _announce_ready(self) -> None:
        if await self.client.wait_ready():
            self.metrics.pages_total.set(self.client.info.pages_total)
            if self.on_ready is not None:
                self.on_ready(self.client.info)
        elif self.client.state == FAILED:
            log.error("the engine core failed to start: %s", self.client.error)

    # -- request parsing
    async def _parse(self, request: Request, schema: type[BaseModel]) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, not a JSON {type(body).__name__}")
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            msg, param = validation_message(exc.errors()[0])
            raise APIError(400, msg, param=param) from None
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

    def _validate(self, req: _Request, prompts: list[list[int]], max_tokens: int) -> None:
        """Every id in the vocabulary, every prompt + max_tokens within max_seq_len (the engine core
        checks again; this answers before the request is queued)."""
        info = self.client.info
        vocab, limit = info.vocab_size, info.max_seq_len
        for k, p in enumerate(prompts):
            where = f"prompt {k}" if len(prompts) > 1 else "prompt"
            bad = next(((i, t) for i, t in enumerate(p) if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad[1]} at {where} position {bad[0]} is outside the model's "
                                    f"vocabulary [0, {vocab})", param="prompt")
            if len(p) + max_tokens > limit:
                raise APIError(400, f"{where} ({len(p)} tokens) + max_tokens ({max_tokens}) = {len(p) + max_tokens}, "
                                    f"over the model's max_seq_len={limit}; shorten the prompt or lower max_tokens",
                               param="max_tokens" if len(p) < limit else "prompt")
        for name, ids in req.token_ids_to_check().items():
            bad_ids = [t for t in ids if not 0 <= t < vocab]
            if bad_ids:
                raise APIError(400, f"{name}: token id {bad_ids[0]} is outside the model's vocabulary [0, {vocab})",
                               param=name)

    # -- metrics
    def _observe_step(self, msg: StepOutputs) -> None:
        now = time.monotonic()
        m = self.metrics
        st = msg.stats
        m.pages_cached.set(st.pages_cached)
        self._prefix_seen = m.engine_totals(st.prefix_query_tokens, st.prefix_hit_tokens, self._prefix_seen)
        for t in msg.tokens:
            tm = self._timing.get(t.id)
            if tm is None:
                continue
            if tm[1] == 0.0:
                tm[1] = now
                m.ttft.observe(now - tm[0])
            else:
                m.itl.observe(now - tm[2])
            tm[2] = now
        for f in msg.finished:
            tm = self._timing.pop(f.id, None)
            m.finished.labels(finish_reason=f.reason).inc()
            if tm is not None and tm[1]:
                m.e2e.observe(now - tm[0])
        m.tokens(len(msg.tokens), now)
        s = msg.stats
        m.running.set(s.running)
        m.waiting.set(s.waiting)
        m.pages_used.set(s.pages_used)
        m.pages_total.set(s.pages_total)

    # -- submission
    def _submit(self, prompts: list[list[int]], params: Any, n: int, stops: Sequence[str]
                ) -> tuple[asyncio.Queue, list[Choice]]:
        queue: asyncio.Queue = asyncio.Queue()
        choices: list[Choice] = []
        now = time.monotonic()
        for p in prompts:
            stream: RequestStream = self.client.add(p, params, n, queue)
            for cid in stream.ids:
                choices.append(Choice(len(choices), cid, p, TextStream(self.tokenizer, stops)))
                self._timing[cid] = [now, 0.0, 0.0]
            self.metrics.prompt.inc(len(p))
        return queue, choices

    def _token_str(self, token: int) -> str:
        s = self._token_text.get(token)
        if s is None:
            s = self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"
            if len(self._token_text) < 200_000:
                self._token_text[token] = s
        return s

    def _apply(self, by_id: dict[int, Choice], item: Union[TokenOut, Finished]) -> Optional[Choice]:
        """Fold one engine output into its choice; returns the choice it changed (None if ignored)."""
        c = by_id.get(item.id)
        if c is None or c.finish_reason is not None or c.failed is not None:
            return None
        if isinstance(item, TokenOut):
            if c.text.stopped:
                return None  # tokens after a stop string: the abort is on its way
            c.generated.append(item.token)
            c.logprobs.append(item.logprob)
            if item.cached_tokens is not None:
                c.cached_tokens = item.cached_tokens
            if item.prompt_logprobs is not None:
                c.prompt_logprobs = item.prompt_logprobs
            return c
        reason, error = _finish_reason(c, item)
        if error is not None:
            c.failed = error
        else:
            c.finish_reason = reason
        return c

    @staticmethod
    def _absorb(changed: list[Choice], sent: dict[int, int]) -> list[tuple[Choice, list[int], str]]:
        """Detokenize what `changed` choices received since `sent[c.id]` tokens: per choice (the
        new tokens that are the choice's: none past a stop string, their text). A choice whose text
        hit a stop string finishes with "stop" whatever the engine said."""
        out = []
        for c in {id(c): c for c in changed}.values():
            new = c.generated[sent[c.id]:]
            delta = c.text.add(new)
            if c.text.stopped:
                new = new[: max(0, len(c.text.ids) - sent[c.id])]
                if c.finish_reason is not None:
                    c.finish_reason = "stop"
            sent[c.id] += len(new)
            out.append((c, new, delta))
        return out

    async def _outputs(self, request: Request, queue: asyncio.Queue, choices: list[Choice], poll: bool
                       ) -> AsyncIterator[list[Union[TokenOut, Finished]]]:
        """Batches of engine outputs until every choice ended (all that is queued at once: a slow
        client gets several tokens per chunk instead of falling behind). Cancels the choices that
        are still running when the consumer stops early (client gone)."""
        open_ = {c.id for c in choices}
        try:
            while open_:
                if poll:
                    try:
                        first = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                else:
                    first = await queue.get()
                batch = [first]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for item in batch:
                    if isinstance(item, Finished):
                        open_.discard(item.id)
                yield batch
        finally:
            if open_:
                self.client.abort(sorted(open_))

    def _stop_strings_seen(self, changed: list[Choice]) -> None:
        stopped = [c.id for c in changed if c.text.stopped and c.finish_reason is None and c.failed is None]
        if stopped:
            self.client.abort(stopped)

    # -- responses
    def _usage(self, prompts: list[list[int]], choices: list[Choice]) -> dict[str, Any]:
        """OpenAI's usage. Each prompt counts once however many choices it has, and so do its cached
        tokens: choice 0's (the others share choice 0's pages; their own count is not the prompt's)."""
        p = sum(len(x) for x in prompts)
        g = sum(len(c.generated) for c in choices)
        n = max(1, len(choices) // max(1, len(prompts)))
        cached = sum(c.cached_tokens for c in choices if c.index % n == 0)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _completion_logprobs(self, c: Choice, tokens: Sequence[int], lps: Sequence[Optional[Logprob]]
                             ) -> dict[str, Any]:
        """OpenAI's legacy completion logprobs for `tokens` (their text starts at the choice's
        `text_offset`: what it streamed so far)."""
        strs = [self._token_str(t) for t in tokens]
        offsets, off = [], c.text_offset
        for s in strs:
            offsets.append(off)
            off += len(s)
        top: list[Optional[dict[str, float]]] = []
        for t, lp in zip(tokens, lps):
            if lp is None:
                top.append(None)
                continue
            d = {self._token_str(i): v for i, v in lp.top}
            d.setdefault(self._token_str(t), lp.logprob)
            top.append(d)
        return {"tokens": strs, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, tokens: Sequence[int], lps: Sequence[Optional[Logprob]]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self._token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in zip(tokens, lps) if lp is not None]}

    def _echo_text(self, prompt: Union[str, list[int]], ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    async def completion(self, request: Request, chat: bool) -> Response:
        req = await self._parse(request, ChatCompletionRequest if chat else CompletionRequest)
        info = self._require_ready()
        if chat:
            sources: list[Union[str, list[int]]] = [self._chat_prompt(req)]
            prompts = [list(sources[0])]  # type: ignore[arg-type]
            max_tokens = req.max_tokens or req.max_completion_tokens or max(1, info.max_seq_len - len(prompts[0]))
        else:
            sources = req.prompts()
            prompts = [self._encode(p) for p in sources]
            max_tokens = req.max_tokens or req.max_completion_tokens or 16
        try:
            params = req.sampling(max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        self._validate(req, prompts, max_tokens)
        echo = (not chat) and req.echo
        queue, choices = self._submit(prompts, params, req.n, req.stop or ())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            gen = self._stream(request, req, params, queue, choices, prompts, sources, rid, chat, echo)
            return StreamingResponse(gen, media_type="text/event-stream")
        by_id = {c.id: c for c in choices}
        sent = {c.id: 0 for c in choices}
        async for batch in self._outputs(request, queue, choices, poll=True):
            changed = [c for item in batch if (c := self._apply(by_id, item)) is not None]
            self._absorb(changed, sent)
            self._stop_strings_seen(changed)
        if any(c.failed for c in choices):
            raise APIError(500, f"generation failed: {next(c.failed for c in choices if c.failed)}",
                           kind="server_error")
        if any(c.finish_reason is None for c in choices):  # client gone
            return Response(status_code=499)
        out = []
        n = req.n
        for c in choices:
            c.text.finish()
            item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None}
            src = sources[c.index // n]
            kept = sent[c.id]  # tokens past a stop string are not the choice's
            if chat:
                item["message"] = {"role": "assistant", "content": c.text.emitted}
                if params.logprobs is not None:
                    item["logprobs"] = self._chat_logprobs(c.generated[:kept], c.logprobs[:kept])
            else:
                prefix = self._echo_text(src, c.prompt) if echo else ""
                item["text"] = prefix + c.text.emitted
                if params.logprobs is not None:
                    toks, lps = list(c.generated[:kept]), list(c.logprobs[:kept])
                    if echo:
                        toks, lps = c.prompt + toks, list(c.prompt_logprobs or [None] * len(c.prompt)) + lps
                    item["logprobs"] = self._completion_logprobs(c, toks, lps)
            if req.return_token_ids:
                item["prompt_token_ids"] = c.prompt
                item["token_ids"] = c.generated[:kept]
            out.append(item)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": out,
                             "usage": self._usage(prompts, choices)})

    async def _stream(self, request: Request, req: Any, params: Any, queue: asyncio.Queue, choices: list[Choice],
                      prompts: list[list[int]], sources: list[Any], rid: str, chat: bool, echo: bool
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_lp = params.logprobs is not None
        by_id = {c.id: c for c in choices}
        sent = {c.id: 0 for c in choices}  # generated tokens already streamed per choice

        def chunk(c: Choice, text: Optional[str], finish: Optional[str] = None, ids: Sequence[int] = (),
                  lps: Sequence[Optional[Logprob]] = (), first: bool = False, prefix: str = "",
                  prompt_ids: Sequence[int] = (), prompt_lps: Sequence[Optional[Logprob]] = ()) -> str:
            item: dict[str, Any] = {"index": c.index, "finish_reason": finish, "logprobs": None}
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                item["delta"] = delta
                if want_lp and ids:
                    item["logprobs"] = self._chat_logprobs(ids, lps)
            else:
                item["text"] = prefix + (text or "")
                if want_lp and (ids or prompt_ids):
                    item["logprobs"] = self._completion_logprobs(c, [*prompt_ids, *ids], [*prompt_lps, *lps])
                    c.text_offset += len(prefix) + len(text or "")
            if req.return_token_ids:
                if first:
                    item["prompt_token_ids"] = c.prompt
                item["token_ids"] = list(ids)
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [item]}
            if req.include_usage_in_stream:
                body["usage"] = None
            return f"data: {_json(body)}\n\n"

        started: set[int] = set()
        echoed: set[int] = set()
        for c in choices:
            if chat or req.return_token_ids:
                yield chunk(c, "", first=True)
                started.add(c.id)
        async for batch in self._outputs(request, queue, choices, poll=False):
            changed = [c for item in batch if (c := self._apply(by_id, item)) is not None]
            for c, new, delta in self._absorb(changed, sent):
                lps = c.logprobs[sent[c.id] - len(new): sent[c.id]]
                prefix, p_ids, p_lps = "", (), ()
                if echo and c.id not in echoed and (new or c.finish_reason is not None):
                    prefix = self._echo_text(sources[c.index // req.n], c.prompt)
                    p_ids = c.prompt
                    p_lps = list(c.prompt_logprobs or [None] * len(c.prompt))
                    echoed.add(c.id)
                if c.failed is not None:
                    yield f"data: {_json(error_body(f'generation failed: {c.failed}', 'server_error'))}\n\n"
                    continue
                fin = c.finish_reason
                if fin is not None:
                    delta += c.text.finish()
                if new or delta or prefix or fin is not None:
                    yield chunk(c, delta, fin, new, lps, first=c.id not in started, prefix=prefix,
                                prompt_ids=p_ids, prompt_lps=p_lps)
                    started.add(c.id)
            self._stop_strings_seen(changed)
        if any(c.finish_reason is None for c in choices):
            return  # a choice failed (its error event was sent), or the client is gone
        if req.include_usage_in_stream:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                    "usage": self._usage(prompts, choices)}
            yield f"data: {_json(body)}\n\n"
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
            await self.client.start()
            announce = asyncio.create_task(self._announce_ready())
            yield
            announce.cancel()
            await self.client.shutdown(self.drain_timeout_s)
            if self.client.pages_leaked:
                log.error("the engine core ended with %d cache pages still held", self.client.pages_leaked)

        app = FastAPI(title="autodeploy-mla", lifespan=lifespan)
        app.state.server = self

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            info = self.client.info
            card: dict[str, Any] = {"id": self.model_name, "object": "model", "created": self.created,
                                    "owned_by": "autodeploy-mla"}
            if info is not None:
                card.update(max_model_len=info.max_seq_len, vocab_size=info.vocab_size)
            return {"object": "list", "data": [card]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completion(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.completion(request, chat=True)

        @app.get("/health")
        async def health() -> Response:
            c = self.client
            if c.alive:
                return JSONResponse({"status": "ok"})
            if c.state == STARTING:
                return JSONResponse({"status": "starting", "progress": c.progress}, status_code=503)
            return JSONResponse({"status": c.state, "error": c.error or c.state}, status_code=503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        return app


def create_app(model: Any, tokenizer: Any = None, model_name: str = "model", drain_timeout_s: float = 10.0) -> FastAPI:
    """The FastAPI app serving `model`: an `OptimizedModel` (the engine core in a thread of this
    process) or an `AppConfig` (the engine core in a process of its own, which builds it)."""
    return Server(core_for(model), tokenizer, model_name, drain_timeout_s).app()


def core_for(model: Any) -> CoreHandle:
    from ..config.schema import AppConfig

    if isinstance(model, AppConfig):
        return ProcessCore(model)
    if hasattr(model, "runner") and hasattr(model, "engine"):
        return ThreadCore(model)
    if hasattr(model, "start") and hasattr(model, "is_alive"):
        return model
    raise TypeError(f"serve an OptimizedModel, an AppConfig or an engine-core handle, not {type(model).__name__}")


class UvicornServer(uvicorn.Server):
    """uvicorn for one `Server`, with a shutdown that drains: on Ctrl-C (or `should_exit`) it
    refuses new connections at once, tells the engine core to give running requests the drain
    timeout and then cancel the rest (their streams end with an error event), so the connections
    close and uvicorn finishes (uvicorn alone would wait for every stream to run to its end). An
    engine failure makes it stop on its own (the server's `exit_code` is then 1)."""

    def __init__(self, server: Server, host: str, port: int, log_level: str = "info") -> None:
        self.serving = server
        server.request_exit = self._exit
        super().__init__(uvicorn.Config(server.app(), host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=int(server.drain_timeout_s) + 30))

    def _exit(self) -> None:
        self.should_exit = True

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        self.serving.client.begin_shutdown(self.serving.drain_timeout_s)
        await super().shutdown(sockets)


class ServerThread:
    """Serve a model from a background thread on a free local port (tests, benchmarks, notebooks):

        with ServerThread(cfg, tokenizer, "tiny") as url:     # AppConfig: engine core in its own process
            OpenAI(base_url=f"{url}/v1", api_key="-").completions.create(...)
        with ServerThread(om) as url: ...                     # OptimizedModel: engine core in a thread

    `start()` returns once the server answers and (unless `wait_ready=False`) the model is ready.
    Leaving the block shuts the server down (running requests get `drain_timeout_s`)."""

    def __init__(self, model: Any, tokenizer: Any = None, model_name: str = "model", drain_timeout_s: float = 10.0,
                 host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 600.0, wait_ready: bool = True,
                 failure_grace_s: float = 3.0) -> None:
        self.server = Server(core_for(model), tokenizer, model_name, drain_timeout_s, failure_grace_s)
        self.host, self.port = host, port or _free_port(host)
        self._uvicorn = UvicornServer(self.server, host, self.port, log_level="warning")
        self._thread: Optional[threading.Thread] = None
        self._start_timeout_s = start_timeout_s
        self._wait_ready = wait_ready

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def client(self) -> EngineCoreClient:
        return self.server.client

    def start(self) -> str:
        self._thread = threading.Thread(target=self._uvicorn.run, name="autodeploy-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._uvicorn.started or (self._wait_ready and self.client.state == STARTING):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url} ({self.client.progress})")
            time.sleep(0.01)
        if self._wait_ready and self.client.state == FAILED:
            self.stop()
            raise RuntimeError(f"the engine core failed to start: {self.client.error}")
        return self.url

    def stop(self, timeout_s: float = 120.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _json(body: Any) -> str:
    """JSON text of an SSE chunk (msgspec's encoder: several times json.dumps' speed, on the one path
    that runs per token per stream)."""
    return _ENCODER.encode(body).decode()


_ENCODER = msgspec.json.Encoder()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
