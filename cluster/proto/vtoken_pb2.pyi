from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "ignore_eos", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "logprobs", "bad_words", "logit_bias", "allowed_token_ids", "truncate_prompt_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    logprobs: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    truncate_prompt_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., logprobs: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class VTokenOptions(_message.Message):
    __slots__ = ("policy", "budget", "interval", "sink", "recent", "seed", "policy_params", "prefill_evict", "prefill_window", "evict", "pressure_floor")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_EVICT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WINDOW_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    policy: str
    budget: float
    interval: int
    sink: int
    recent: int
    seed: int
    policy_params: _struct_pb2.Struct
    prefill_evict: bool
    prefill_window: int
    evict: str
    pressure_floor: float
    def __init__(self, policy: _Optional[str] = ..., budget: _Optional[float] = ..., interval: _Optional[int] = ..., sink: _Optional[int] = ..., recent: _Optional[int] = ..., seed: _Optional[int] = ..., policy_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., prefill_evict: _Optional[bool] = ..., prefill_window: _Optional[int] = ..., evict: _Optional[str] = ..., pressure_floor: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "sampling", "deadline_ms", "vtoken")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    VTOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: ChatMessages
    sampling: SamplingParams
    deadline_ms: int
    vtoken: VTokenOptions
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., deadline_ms: _Optional[int] = ..., vtoken: _Optional[_Union[VTokenOptions, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "replica", "text", "token_ids", "finished", "finish_reason", "prompt_tokens", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    replica: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    prompt_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., replica: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("name", "state", "free_blocks", "total_blocks", "promised_blocks", "blocks_reclaimed", "blocks_freed", "live_tokens", "running", "waiting", "report_age_s", "node_ip", "node_id", "pid", "prefix_queries", "prefix_hits", "prefix_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMISED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    LIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    free_blocks: int
    total_blocks: int
    promised_blocks: int
    blocks_reclaimed: int
    blocks_freed: int
    live_tokens: int
    running: int
    waiting: int
    report_age_s: float
    node_ip: str
    node_id: str
    pid: int
    prefix_queries: int
    prefix_hits: int
    prefix_blocks: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., promised_blocks: _Optional[int] = ..., blocks_reclaimed: _Optional[int] = ..., blocks_freed: _Optional[int] = ..., live_tokens: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., report_age_s: _Optional[float] = ..., node_ip: _Optional[str] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...

class ScalingDecision(_message.Message):
    __slots__ = ("time", "from_replicas", "to_replicas", "reason")
    TIME_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    time: float
    from_replicas: int
    to_replicas: int
    reason: str
    def __init__(self, time: _Optional[float] = ..., from_replicas: _Optional[int] = ..., to_replicas: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("replicas", "totals", "placement", "target_replicas", "decisions", "last_recovery_s", "controller_node_ip", "controller_node_id", "controller_pid")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_NODE_IP_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_PID_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    totals: ReplicaStatus
    placement: str
    target_replicas: int
    decisions: _containers.RepeatedCompositeFieldContainer[ScalingDecision]
    last_recovery_s: float
    controller_node_ip: str
    controller_node_id: str
    controller_pid: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., totals: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., placement: _Optional[str] = ..., target_replicas: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[ScalingDecision, _Mapping]]] = ..., last_recovery_s: _Optional[float] = ..., controller_node_ip: _Optional[str] = ..., controller_node_id: _Optional[str] = ..., controller_pid: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    def __init__(self, replicas: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("target_replicas",)
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    target_replicas: int
    def __init__(self, target_replicas: _Optional[int] = ...) -> None: ...

class WatchCapacityRequest(_message.Message):
    __slots__ = ("min_interval_s",)
    MIN_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    min_interval_s: float
    def __init__(self, min_interval_s: _Optional[float] = ...) -> None: ...

class ReplicaCapacity(_message.Message):
    __slots__ = ("name", "state", "free_blocks", "total_blocks", "blocks_reclaimed", "promised_blocks", "running", "waiting", "block_size", "report_time")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    PROMISED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPORT_TIME_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    free_blocks: int
    total_blocks: int
    blocks_reclaimed: int
    promised_blocks: int
    running: int
    waiting: int
    block_size: int
    report_time: float
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., blocks_reclaimed: _Optional[int] = ..., promised_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., block_size: _Optional[int] = ..., report_time: _Optional[float] = ...) -> None: ...

class CapacityUpdate(_message.Message):
    __slots__ = ("sequence", "time", "replicas")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    time: float
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaCapacity]
    def __init__(self, sequence: _Optional[int] = ..., time: _Optional[float] = ..., replicas: _Optional[_Iterable[_Union[ReplicaCapacity, _Mapping]]] = ...) -> None: ...
