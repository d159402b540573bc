"""The OpenAI request schema the server accepts (a subset), with its extensions.

Unknown fields are ignored, as OpenAI clients send some (`user`, `stream_options`, ...); fields
whose non-default values the server cannot honour (`n > 1`, `logprobs`, `echo`, penalties,
`logit_bias`, `best_of`) are refused with a 400 that names them. Extensions: `top_k`,
`stop_token_ids`, `ignore_eos`, `return_token_ids` (prompt and generated ids per choice, so a model
without a tokenizer can be served on token ids).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..runtime.sampling import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # extension; 0 or -1: off
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: list[int] = Field(default_factory=list)  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    return_token_ids: bool = False  # extension
    # accepted only at their defaults
    n: int = 1
    logprobs: Optional[Any] = None
    top_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    best_of: Optional[int] = None
    echo: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop: at most 16 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _supported(self) -> "_Request":
        unsupported = []
        if self.n != 1:
            unsupported.append(f"n={self.n} (only 1)")
        if self.logprobs not in (None, False, 0):
            unsupported.append("logprobs")
        if self.top_logprobs:
            unsupported.append("top_logprobs")
        if self.presence_penalty or self.frequency_penalty:
            unsupported.append("presence_penalty / frequency_penalty")
        if self.logit_bias:
            unsupported.append("logit_bias")
        if self.best_of not in (None, 1):
            unsupported.append("best_of")
        if self.echo:
            unsupported.append("echo")
        if unsupported:
            raise ValueError(f"not supported by this server: {', '.join(unsupported)}")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                              top_p=self.top_p, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt: empty list")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per choice: a text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


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


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
