from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PullKVRequest(_message.Message):
    __slots__ = ("request_id", "capability", "from_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    FROM_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capability: str
    from_position: int
    def __init__(self, request_id: _Optional[str] = ..., capability: _Optional[str] = ..., from_position: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("seq", "total", "header", "data", "crc32")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    seq: int
    total: int
    header: bytes
    data: bytes
    crc32: int
    def __init__(self, seq: _Optional[int] = ..., total: _Optional[int] = ..., header: _Optional[bytes] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "capability")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    capability: str
    def __init__(self, request_id: _Optional[str] = ..., capability: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
