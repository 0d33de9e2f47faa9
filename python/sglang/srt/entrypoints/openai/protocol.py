"""OpenAI-compatible request models (pydantic) with SGLang's extensions; validation errors name the field.

Unknown fields are ignored (clients send vendor fields freely); known fields are type- and range-checked.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # OpenAI's range for `seed`; torch seeds take 64 bits


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class BootstrapFields(BaseModel):
    """Prefill/decode disaggregation: what sglang-router adds in its PD mode (checked by
    entrypoints/bootstrap_fields.py, which names the field of a malformed value)."""

    # Any: kept as sent, so "5" or true is refused there rather than coerced to 5 here
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None


class SamplingFields(BootstrapFields):
    """Sampling options shared by completions and chat (OpenAI names plus SGLang's extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: Optional[int] = None
    user: Optional[str] = None
    # SGLang extensions
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=2)
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = Field(default=0, ge=0)  # no stop condition applies before this many tokens
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None  # constrained decoding (at most one of the three)
    ebnf: Optional[str] = None
    json_schema: Optional[str] = None
    logit_bias: Optional[dict] = None  # {token id: bias in [-100, 100]} (checked with the other sampling fields)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and (len(v) > 16 or not all(v)):
            raise ValueError("stop must hold 1 to 16 non-empty strings")
        if v == "":
            raise ValueError("stop must be a non-empty string")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, in [{INT64_MIN}, {INT64_MAX}]")
        return v


COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=COMPLETION_MAX_TOKENS, ge=1)  # null: the default (as OpenAI)
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    response_format: Optional[dict] = None  # json_object / json_schema, as chat's
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of other than 1 is not supported; use n")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class FunctionDef(BaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(BaseModel):
    name: str
    arguments: Union[str, dict]


class ToolCall(BaseModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: Optional[Union[str, list[dict]]] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict] = "auto"
    parallel_tool_calls: bool = True  # false: at most one tool call per choice (the first the model writes)
    response_format: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict] = None
    separate_reasoning: bool = True
    return_meta_info: bool = False  # SGLang's extension: each choice carries the engine's meta_info (non-streaming)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as OpenAI: top_logprobs > 0 only with logprobs true
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class GenerateRequest(BootstrapFields):
    """Native /generate: one prompt or a batch, as text or token ids."""

    model_config = ConfigDict(extra="ignore")

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    rid: Optional[Union[str, list[str]]] = None


class TokenizeRequest(BaseModel):
    prompt: Union[str, list[str]]
    model: Optional[str] = None


class DetokenizeRequest(BaseModel):
    tokens: list[Any]
    model: Optional[str] = None


class AbortRequest(BaseModel):
    """/abort_request (SGLang's): one request by its rid (and the samples of a /generate that gave it), or all."""

    model_config = ConfigDict(extra="ignore")

    rid: Optional[str] = None
    abort_all: bool = False


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's Responses API; serving_responses.py turns it into a chat request). Sampling
    extensions of the chat endpoint (top_k, min_p, stop, seed, ...) are accepted too."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = "auto"
    parallel_tool_calls: bool = True
    reasoning: Optional[dict] = None  # {"effort": "low" | "medium" | "high" | ...}
    text: Optional[dict] = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict] = None
    user: Optional[str] = None
    background: bool = False
    truncation: Optional[Literal["disabled", "auto"]] = "disabled"


class UpdateWeightsFromDiskRequest(BaseModel):
    """/update_weights_from_disk (SGLang's): a checkpoint directory (or hub id) of the served architecture."""

    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(min_length=1)
    load_format: Optional[Literal["auto", "safetensors"]] = None  # the only format we load
    abort_all_requests: bool = False  # abort running requests instead of letting them finish first


MAX_WEIGHT_ROWS = 1000  # rows of one /get_weights_by_name answer: enough to check an update, a bounded reply


class GetWeightsByNameRequest(BaseModel):
    """/get_weights_by_name (SGLang's): the first `truncate_size` rows of the weight loaded from a checkpoint tensor."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=1, le=MAX_WEIGHT_ROWS)


class ProfileRequest(BaseModel):
    """/start_profile's body (every field optional; managers/scheduler_profiler.py). Upstream's staged and merged
    profiles are not served: those fields are accepted at their defaults only."""

    model_config = ConfigDict(extra="ignore")

    output_dir: Optional[str] = None
    num_steps: Optional[int] = Field(default=None, ge=1)
    activities: Optional[list[Literal["CPU", "GPU", "MEM", "CUDA_PROFILER"]]] = Field(default=None, min_length=1)
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None
    # the start of each trace's file name: no path separators (the traces stay in output_dir)
    profile_prefix: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    profile_id: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")  # upstream's name for it
    start_step: Optional[int] = None  # not served: a profile starts at the next step
    profile_by_stage: bool = False
    merge_profiles: bool = False

    @field_validator("start_step", "profile_by_stage", "merge_profiles")
    @classmethod
    def _served(cls, value):
        if value not in (None, False):
            raise ValueError("not supported by this server (a profile starts at the next scheduler step and each "
                             "rank writes its own trace); leave it out")
        return value


def error_body(message: str, status_code: int, param: Optional[str] = None) -> dict:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
            405: "MethodNotAllowedError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
            429: "RateLimitError", 499: "ClientDisconnectedError", 503: "ServiceUnavailableError"}.get(status_code)
    if kind is None:
        kind = "BadRequestError" if 400 <= status_code < 500 else "InternalServerError"
    detail = {"message": message, "type": kind, "param": param, "code": status_code}
    # SGLang's flat ErrorResponse, plus OpenAI's nested {"error": {...}} for clients that read that shape
    return {"object": "error", **detail, "error": detail}
