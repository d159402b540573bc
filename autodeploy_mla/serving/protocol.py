"""The OpenAI request schema the server accepts, with its extensions.

Types are strict: `"4"` is not a `max_tokens`, `true` is not a token id, NaN is not a temperature.
Unknown fields are ignored, as OpenAI clients send some (`user`, ...); fields the server cannot
honour (`best_of` other than n, `suffix`) are refused with a 400 that names them.

Supported beyond the basics: `n` (choices share the prompt's prefill), `logprobs` (completions: the
number of alternatives, 0-20; chat: `logprobs: true` + `top_logprobs` 0-20), `echo` (completions:
the prompt is returned before the completion, with its tokens' logprobs when `logprobs` is set, the
first one null), `presence_penalty` / `frequency_penalty` (-2..2, over generated tokens),
`logit_bias` (token id -> -100..100). Extensions: `top_k`, `repetition_penalty` (> 0, over prompt
and generated tokens), `stop_token_ids`, `ignore_eos`, `return_token_ids` (prompt and generated ids
per choice, so a model without a tokenizer can be served on token ids).

Logprobs are of the distribution the token was drawn from: the model's logits after
`repetition_penalty`, the frequency/presence penalties and `logit_bias`, divided by the temperature
(1 for greedy requests), log-softmaxed over the whole vocabulary, before top-k / top-p truncation.
Prompt tokens' logprobs (`echo`) are the model's own log-softmax, with no penalty, bias or
temperature (nothing was drawn there), as vLLM's prompt logprobs are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..runtime.sampling import SamplingParams

Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MAX_LOGPROBS = 20
MAX_N = 16


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[Annotated[int, Field(strict=True, ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(strict=True, ge=1)]] = None
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=100.0)] = 1.0  # OpenAI's
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=-1)] = 0  # extension; 0 or -1: off
    seed: Optional[Annotated[int, Field(strict=True, ge=0, lt=2**63)]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[Int] = Field(default_factory=list)  # extension
    ignore_eos: Annotated[bool, Field(strict=True)] = False  # extension
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: Optional[dict[str, Any]] = None
    return_token_ids: Annotated[bool, Field(strict=True)] = False  # extension
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] = 1
    presence_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=100.0)] = 1.0
    logit_bias: Optional[dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-100.0, le=100.0)]]] \
        = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("at most 16 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if v is None:
            return None
        if len(v) > 300:
            raise ValueError(f"{len(v)} entries; at most 300")
        for k in v:
            if not k.lstrip("-").isdigit():
                raise ValueError(f"key {k!r} is not a token id (the keys are token ids as strings, e.g. \"50256\")")
        return v

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def _logprobs(self) -> tuple[Optional[int], Optional[int]]:
        """(logprobs of generated tokens, logprobs of prompt tokens): the number of alternatives each, or None."""
        raise NotImplementedError

    def sampling(self, max_tokens: int) -> SamplingParams:
        logprobs, prompt_logprobs = self._logprobs()
        bias = tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                              top_p=self.top_p, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """Token ids this request names besides its prompt (checked against the vocabulary)."""
        return {"stop_token_ids": list(self.stop_token_ids),
                "logit_bias": [int(k) for k in (self.logit_bias or {})]}


class CompletionRequest(_Request):
    prompt: Any
    logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]] = None
    echo: Annotated[bool, Field(strict=True)] = False
    best_of: Optional[Annotated[int, Field(strict=True, ge=1)]] = None
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Union[str, list[str], list[int], list[list[int]]]:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(x, str) for x in v):
                return v
            if _token_ids(v):
                return v
            if all(_token_ids(x) for x in v):
                return v
        raise ValueError("must be a string, a list of strings, a list of token ids (integers), or a list of "
                         f"token-id lists, none of them empty; got {_describe(v)}")

    @model_validator(mode="after")
    def _supported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of}: only best_of == n is supported")
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        return self

    def _logprobs(self) -> tuple[Optional[int], Optional[int]]:
        return self.logprobs, (self.logprobs if self.echo and self.logprobs is not None else None)

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: a text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if _token_ids(p):
            return [list(p)]
        return list(p)


def _describe(v: Any) -> str:
    if isinstance(v, list):
        if not v:
            return "an empty list"
        kinds = sorted({type(x).__name__ for x in v})
        return f"a list of {' / '.join(kinds)}"
    return f"a value of type {type(v).__name__}"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Annotated[bool, Field(strict=True)] = False
    top_logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]] = None

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _logprobs(self) -> tuple[Optional[int], Optional[int]]:
        return (self.top_logprobs or 0) if self.logprobs else None, None


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(err: dict[str, Any]) -> tuple[str, Optional[str]]:
    """(message, param) for one pydantic error: the field, then what was wrong, without pydantic's
    "Value error, " prefix."""
    loc = ".".join(str(p) for p in err.get("loc", ())) or None
    msg = str(err.get("msg", ""))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if err.get("type") == "missing":
        msg = "required field missing"
    param = str(err["loc"][0]) if err.get("loc") else None
    return (f"{loc}: {msg}" if loc else msg), param
