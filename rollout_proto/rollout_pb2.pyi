from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "stop", "min_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "prompt_token_ids", "prompt_text", "num_samples", "sampling", "prompt_id", "metadata", "multi_turn")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MULTI_TURN_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    num_samples: int
    sampling: SamplingParams
    prompt_id: str
    metadata: _containers.ScalarMap[str, str]
    multi_turn: MultiTurn
    def __init__(self, group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., multi_turn: _Optional[_Union[MultiTurn, _Mapping]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("groups", "batch_id")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[PromptGroup]
    batch_id: str
    def __init__(self, groups: _Optional[_Iterable[_Union[PromptGroup, _Mapping]]] = ..., batch_id: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("group_ids", "created", "incarnation")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    created: _containers.RepeatedScalarFieldContainer[bool]
    incarnation: str
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., created: _Optional[_Iterable[bool]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StreamSamplesRequest(_message.Message):
    __slots__ = ("consumer_id", "from_cursor")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_CURSOR_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    from_cursor: int
    def __init__(self, consumer_id: _Optional[str] = ..., from_cursor: _Optional[int] = ...) -> None: ...

class VersionSegment(_message.Message):
    __slots__ = ("version", "start", "length")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    length: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queued_at", "first_token_at", "finished_at")
    QUEUED_AT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    queued_at: float
    first_token_at: float
    finished_at: float
    def __init__(self, queued_at: _Optional[float] = ..., first_token_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sample_id", "group_id", "index", "prompt_id", "prompt_token_ids", "response_token_ids", "logprobs", "versions", "min_version", "max_version", "finish_reason", "engines", "num_migrations", "timing", "spec", "response_text", "metadata", "batch_id", "drop_reason", "turns", "loss_mask")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_REASON_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    group_id: str
    index: int
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedCompositeFieldContainer[VersionSegment]
    min_version: int
    max_version: int
    finish_reason: FinishReason
    engines: _containers.RepeatedScalarFieldContainer[str]
    num_migrations: int
    timing: Timing
    spec: SpecStats
    response_text: str
    metadata: _containers.ScalarMap[str, str]
    batch_id: str
    drop_reason: str
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_id: _Optional[str] = ..., group_id: _Optional[str] = ..., index: _Optional[int] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[_Union[VersionSegment, _Mapping]]] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., engines: _Optional[_Iterable[str]] = ..., num_migrations: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., response_text: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., batch_id: _Optional[str] = ..., drop_reason: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., loss_mask: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleEvent(_message.Message):
    __slots__ = ("cursor", "sample", "group_complete", "awaiting_observation", "incarnation")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    AWAITING_OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    sample: Sample
    group_complete: bool
    awaiting_observation: bool
    incarnation: str
    def __init__(self, cursor: _Optional[int] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., group_complete: _Optional[bool] = ..., awaiting_observation: _Optional[bool] = ..., incarnation: _Optional[str] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("consumer_id", "cursor")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    cursor: int
    def __init__(self, consumer_id: _Optional[str] = ..., cursor: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked_cursor",)
    ACKED_CURSOR_FIELD_NUMBER: _ClassVar[int]
    acked_cursor: int
    def __init__(self, acked_cursor: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "byte_length", "sha256", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_length: int
    sha256: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., byte_length: _Optional[int] = ..., sha256: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("version", "tensors", "file_path", "target", "checksum_algo")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FILE_PATH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    file_path: str
    target: str
    checksum_algo: str
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., file_path: _Optional[str] = ..., target: _Optional[str] = ..., checksum_algo: _Optional[str] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    data: bytes
    trailer: WeightsTrailer
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[WeightsTrailer, _Mapping]] = ...) -> None: ...

class WeightsTrailer(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digests: _Optional[_Iterable[str]] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("applied_version", "bytes_received", "seconds")
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    applied_version: int
    bytes_received: int
    seconds: float
    def __init__(self, applied_version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("group_ids", "batch_id", "all", "keep_partial")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    KEEP_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    batch_id: str
    all: bool
    keep_partial: bool
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., batch_id: _Optional[str] = ..., all: _Optional[bool] = ..., keep_partial: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_groups", "partial_samples")
    ABORTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    aborted_groups: int
    partial_samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, aborted_groups: _Optional[int] = ..., partial_samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "kind", "state", "running", "waiting", "kv_usage", "tokens_per_s", "policy_version", "assigned")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    kind: str
    state: str
    running: int
    waiting: int
    kv_usage: float
    tokens_per_s: float
    policy_version: int
    assigned: int
    def __init__(self, engine_id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., policy_version: _Optional[int] = ..., assigned: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("policy_version", "engines", "queued_requests", "running_requests", "open_groups", "last_cursor", "retained_samples", "scheduler", "counters", "uptime_s", "model", "spec", "incarnation", "journal_error", "paused")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAST_CURSOR_FIELD_NUMBER: _ClassVar[int]
    RETAINED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    queued_requests: int
    running_requests: int
    open_groups: int
    last_cursor: int
    retained_samples: int
    scheduler: str
    counters: _containers.ScalarMap[str, float]
    uptime_s: float
    model: str
    spec: SpecStatus
    incarnation: str
    journal_error: str
    paused: str
    def __init__(self, policy_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., open_groups: _Optional[int] = ..., last_cursor: _Optional[int] = ..., retained_samples: _Optional[int] = ..., scheduler: _Optional[str] = ..., counters: _Optional[_Mapping[str, float]] = ..., uptime_s: _Optional[float] = ..., model: _Optional[str] = ..., spec: _Optional[_Union[SpecStatus, _Mapping]] = ..., incarnation: _Optional[str] = ..., journal_error: _Optional[str] = ..., paused: _Optional[str] = ...) -> None: ...

class SpecDepthBucket(_message.Message):
    __slots__ = ("min_batch", "max_batch", "num_speculative_tokens", "best_k", "tokens_per_s_per_seq", "observations")
    class TokensPerSPerSeqEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class ObservationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    MIN_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEST_K_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    min_batch: int
    max_batch: int
    num_speculative_tokens: int
    best_k: int
    tokens_per_s_per_seq: _containers.ScalarMap[int, float]
    observations: _containers.ScalarMap[int, int]
    def __init__(self, min_batch: _Optional[int] = ..., max_batch: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., best_k: _Optional[int] = ..., tokens_per_s_per_seq: _Optional[_Mapping[int, float]] = ..., observations: _Optional[_Mapping[int, int]] = ...) -> None: ...

class SpecEngineStatus(_message.Message):
    __slots__ = ("engine_id", "method", "max_k", "draft_version", "steps", "draft_tokens", "accepted_tokens", "mean_acceptance_length", "acceptance_by_position", "buckets", "tuner_decisions", "tuner_explorations")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TUNER_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    TUNER_EXPLORATIONS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    method: str
    max_k: int
    draft_version: int
    steps: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    buckets: _containers.RepeatedCompositeFieldContainer[SpecDepthBucket]
    tuner_decisions: int
    tuner_explorations: int
    def __init__(self, engine_id: _Optional[str] = ..., method: _Optional[str] = ..., max_k: _Optional[int] = ..., draft_version: _Optional[int] = ..., steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., buckets: _Optional[_Iterable[_Union[SpecDepthBucket, _Mapping]]] = ..., tuner_decisions: _Optional[int] = ..., tuner_explorations: _Optional[int] = ...) -> None: ...

class SpecStatus(_message.Message):
    __slots__ = ("method", "tune", "train", "draft_version", "trained_on_policy_version", "trainer_rounds", "engines")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TUNE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINED_ON_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    method: str
    tune: bool
    train: bool
    draft_version: int
    trained_on_policy_version: int
    trainer_rounds: int
    engines: _containers.RepeatedCompositeFieldContainer[SpecEngineStatus]
    def __init__(self, method: _Optional[str] = ..., tune: _Optional[bool] = ..., train: _Optional[bool] = ..., draft_version: _Optional[int] = ..., trained_on_policy_version: _Optional[int] = ..., trainer_rounds: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[SpecEngineStatus, _Mapping]]] = ...) -> None: ...

class MultiTurn(_message.Message):
    __slots__ = ("max_turns", "max_total_tokens", "environment")
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    max_turns: int
    max_total_tokens: int
    environment: str
    def __init__(self, max_turns: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., environment: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("kind", "start", "length", "engine_id", "finish_reason", "started_at", "finished_at", "tool_seconds")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Turn.Kind]
        KIND_GENERATED: _ClassVar[Turn.Kind]
        KIND_OBSERVATION: _ClassVar[Turn.Kind]
    KIND_UNSPECIFIED: Turn.Kind
    KIND_GENERATED: Turn.Kind
    KIND_OBSERVATION: Turn.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    TOOL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: Turn.Kind
    start: int
    length: int
    engine_id: str
    finish_reason: FinishReason
    started_at: float
    finished_at: float
    tool_seconds: float
    def __init__(self, kind: _Optional[_Union[Turn.Kind, str]] = ..., start: _Optional[int] = ..., length: _Optional[int] = ..., engine_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., tool_seconds: _Optional[float] = ...) -> None: ...

class ContinueRequest(_message.Message):
    __slots__ = ("sample_id", "turn", "observation_token_ids", "observation_text", "done")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    turn: int
    observation_token_ids: _containers.RepeatedScalarFieldContainer[int]
    observation_text: str
    done: bool
    def __init__(self, sample_id: _Optional[str] = ..., turn: _Optional[int] = ..., observation_token_ids: _Optional[_Iterable[int]] = ..., observation_text: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...

class ContinueResponse(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    def __init__(self, applied: _Optional[bool] = ...) -> None: ...

class WeightTransferPlanRequest(_message.Message):
    __slots__ = ("backend", "trainer_device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRAINER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    trainer_device: TransferDevice
    def __init__(self, backend: _Optional[str] = ..., trainer_device: _Optional[_Union[TransferDevice, _Mapping]] = ...) -> None: ...

class TransferDevice(_message.Message):
    __slots__ = ("host", "device", "uuid", "pci_bus_id")
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    host: str
    device: str
    uuid: str
    pci_bus_id: str
    def __init__(self, host: _Optional[str] = ..., device: _Optional[str] = ..., uuid: _Optional[str] = ..., pci_bus_id: _Optional[str] = ...) -> None: ...

class WeightTransferPlan(_message.Message):
    __slots__ = ("backend", "world_size", "engine_ids", "first_ranks", "stager_rank")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANKS_FIELD_NUMBER: _ClassVar[int]
    STAGER_RANK_FIELD_NUMBER: _ClassVar[int]
    backend: str
    world_size: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    first_ranks: _containers.RepeatedScalarFieldContainer[int]
    stager_rank: int
    def __init__(self, backend: _Optional[str] = ..., world_size: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., first_ranks: _Optional[_Iterable[int]] = ..., stager_rank: _Optional[int] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "world_size", "timeout_s", "options_json", "trainer_device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRAINER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float
    options_json: str
    trainer_device: TransferDevice
    def __init__(self, backend: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., options_json: _Optional[str] = ..., trainer_device: _Optional[_Union[TransferDevice, _Mapping]] = ...) -> None: ...

class CollectiveUpdateRequest(_message.Message):
    __slots__ = ("version", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class CollectiveUpdateEvent(_message.Message):
    __slots__ = ("phase", "applied_version", "seconds")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[CollectiveUpdateEvent.Phase]
        ACCEPTED: _ClassVar[CollectiveUpdateEvent.Phase]
        RECEIVED: _ClassVar[CollectiveUpdateEvent.Phase]
        LIVE: _ClassVar[CollectiveUpdateEvent.Phase]
    PHASE_UNSPECIFIED: CollectiveUpdateEvent.Phase
    ACCEPTED: CollectiveUpdateEvent.Phase
    RECEIVED: CollectiveUpdateEvent.Phase
    LIVE: CollectiveUpdateEvent.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    phase: CollectiveUpdateEvent.Phase
    applied_version: int
    seconds: float
    def __init__(self, phase: _Optional[_Union[CollectiveUpdateEvent.Phase, str]] = ..., applied_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CloseWeightTransferRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseWeightTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
