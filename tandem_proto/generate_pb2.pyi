from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "max_tokens", "sampling", "stop", "request_id", "priority", "ignore_eos")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: SamplingParameters
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    priority: str
    ignore_eos: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., priority: _Optional[str] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_id", "text", "finish_reason", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_id: int
    text: str
    finish_reason: str
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
