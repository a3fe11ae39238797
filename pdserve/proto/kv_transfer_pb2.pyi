from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkNotice(_message.Message):
    __slots__ = ("request_id", "chunk_index", "tokens_done", "is_last", "first_block", "block_checksums")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_index: int
    tokens_done: int
    is_last: bool
    first_block: int
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., tokens_done: _Optional[int] = ..., is_last: _Optional[bool] = ..., first_block: _Optional[int] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockPayload(_message.Message):
    __slots__ = ("target_id", "block_bytes", "dst_block_ids", "data", "notification")
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    target_id: str
    block_bytes: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    notification: ChunkNotice
    def __init__(self, target_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., notification: _Optional[_Union[ChunkNotice, _Mapping]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("blocks_written", "bytes_written")
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    blocks_written: int
    bytes_written: int
    def __init__(self, blocks_written: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...
