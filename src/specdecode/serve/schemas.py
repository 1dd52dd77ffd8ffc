"""The HTTP API's request and response bodies, as OpenAI names them (pydantic models).

Requests are validated strictly (a string where a number belongs is a 400, not a coercion) but
unknown fields are ignored, as OpenAI's clients expect. ``speculative`` is our one extension:
``{"method": ..., "k": ..., "confidence": ...}`` or ``false`` for plain decoding.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP = 16  # stop strings per request
MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20


StopString = Annotated[str, Field(min_length=1, max_length=256)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class SpeculativeSettings(_Request):
    """Per-request speculation; omitted fields take the server's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)  # a misspelt key here would silently do nothing

    method: str | None = Field(None, description="a method name (see GET /v1/models), 'auto' or 'none'")
    k: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] | None = Field(
        None, description="drafts per round, or 'auto' (planned per step for the whole batch)"
    )
    confidence: float | None = Field(
        None, gt=0.0, lt=1.0, description="a drafter chain stops before a token it gives less than this"
    )


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's extension: usage (tokens so far) in every chunk")


class _Generation(_Request):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="0 or -1: off")
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeSettings | Literal[False] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="prefix-cache scope: reuse only prompt prefixes stored by requests with this salt"
    )


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class CompletionRequest(_Generation):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False


# -- responses (for the OpenAPI document; the handlers build plain dicts of the same shape) -------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class SpeculativeUsage(BaseModel):
    method: str
    k: float = Field(description="mean drafts per round the policy chose")
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted_length: float = Field(description="tokens committed per target call")
    acceptance_rate: float
    target_calls: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    methods: list[str] = Field(description="speculative methods a request may ask for")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
