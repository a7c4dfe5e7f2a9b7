from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    LOADING_DRAFT: _ClassVar[Phase]
    DRAFT_READY: _ClassVar[Phase]
    LOADING_FULL: _ClassVar[Phase]
    SERVING: _ClassVar[Phase]
    DRAINING: _ClassVar[Phase]
PHASE_UNSPECIFIED: Phase
LOADING_DRAFT: Phase
DRAFT_READY: Phase
LOADING_FULL: Phase
SERVING: Phase
DRAINING: Phase

class Hello(_message.Message):
    __slots__ = ("protocol_version", "worker_id", "incarnation", "model", "draft_model", "http_url", "kv_endpoint", "draft_endpoint", "kv_capacity_tokens", "ckpt_budget_bytes", "failure_domain", "auth_token", "page_size", "pid", "max_running_requests", "phase", "engine", "tp", "awaiting_seed", "plane_key", "held_batch", "api_key")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CKPT_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    AWAITING_SEED_FIELD_NUMBER: _ClassVar[int]
    PLANE_KEY_FIELD_NUMBER: _ClassVar[int]
    HELD_BATCH_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    worker_id: str
    incarnation: int
    model: str
    draft_model: str
    http_url: str
    kv_endpoint: str
    draft_endpoint: str
    kv_capacity_tokens: int
    ckpt_budget_bytes: int
    failure_domain: str
    auth_token: str
    page_size: int
    pid: int
    max_running_requests: int
    phase: Phase
    engine: str
    tp: int
    awaiting_seed: bool
    plane_key: str
    held_batch: int
    api_key: str
    def __init__(self, protocol_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., model: _Optional[str] = ..., draft_model: _Optional[str] = ..., http_url: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., draft_endpoint: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., ckpt_budget_bytes: _Optional[int] = ..., failure_domain: _Optional[str] = ..., auth_token: _Optional[str] = ..., page_size: _Optional[int] = ..., pid: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., engine: _Optional[str] = ..., tp: _Optional[int] = ..., awaiting_seed: _Optional[bool] = ..., plane_key: _Optional[str] = ..., held_batch: _Optional[int] = ..., api_key: _Optional[str] = ...) -> None: ...

class DurableTokens(_message.Message):
    __slots__ = ("rid", "tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    tokens: int
    def __init__(self, rid: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("drafted_tokens", "accepted_tokens", "rounds")
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    drafted_tokens: int
    accepted_tokens: int
    rounds: int
    def __init__(self, drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., rounds: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "phase", "running", "waiting", "kv_tokens_used", "ckpt_bytes_used", "ckpt_tokens_held", "durable", "abandoned_checkpoints", "draft", "restored_tokens_total", "completed_total", "ckpt_bytes_sent_total", "ckpt_pages_evicted_total", "restores_total", "reload_seconds", "reload_source", "reload_seed", "awaiting_seed", "pid", "batch_limit")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    CKPT_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CKPT_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    RESTORED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CKPT_BYTES_SENT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CKPT_PAGES_EVICTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESTORES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RELOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELOAD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RELOAD_SEED_FIELD_NUMBER: _ClassVar[int]
    AWAITING_SEED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BATCH_LIMIT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    phase: Phase
    running: int
    waiting: int
    kv_tokens_used: int
    ckpt_bytes_used: int
    ckpt_tokens_held: int
    durable: _containers.RepeatedCompositeFieldContainer[DurableTokens]
    abandoned_checkpoints: _containers.RepeatedScalarFieldContainer[str]
    draft: DraftStats
    restored_tokens_total: int
    completed_total: int
    ckpt_bytes_sent_total: int
    ckpt_pages_evicted_total: int
    restores_total: int
    reload_seconds: float
    reload_source: str
    reload_seed: str
    awaiting_seed: bool
    pid: int
    batch_limit: int
    def __init__(self, seq: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., ckpt_bytes_used: _Optional[int] = ..., ckpt_tokens_held: _Optional[int] = ..., durable: _Optional[_Iterable[_Union[DurableTokens, _Mapping]]] = ..., abandoned_checkpoints: _Optional[_Iterable[str]] = ..., draft: _Optional[_Union[DraftStats, _Mapping]] = ..., restored_tokens_total: _Optional[int] = ..., completed_total: _Optional[int] = ..., ckpt_bytes_sent_total: _Optional[int] = ..., ckpt_pages_evicted_total: _Optional[int] = ..., restores_total: _Optional[int] = ..., reload_seconds: _Optional[float] = ..., reload_source: _Optional[str] = ..., reload_seed: _Optional[str] = ..., awaiting_seed: _Optional[bool] = ..., pid: _Optional[int] = ..., batch_limit: _Optional[int] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("protocol_version", "gateway_id", "heartbeat_interval_ms", "skip_draft")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    SKIP_DRAFT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    gateway_id: str
    heartbeat_interval_ms: int
    skip_draft: bool
    def __init__(self, protocol_version: _Optional[int] = ..., gateway_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., skip_draft: _Optional[bool] = ...) -> None: ...

class Refuse(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class HolderTarget(_message.Message):
    __slots__ = ("worker_id", "kv_endpoint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_endpoint: str
    def __init__(self, worker_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ...) -> None: ...

class AssignHolder(_message.Message):
    __slots__ = ("rid", "holders")
    RID_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    holders: _containers.RepeatedCompositeFieldContainer[HolderTarget]
    def __init__(self, rid: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[HolderTarget, _Mapping]]] = ...) -> None: ...

class DropCheckpoint(_message.Message):
    __slots__ = ("rids",)
    RIDS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rids: _Optional[_Iterable[str]] = ...) -> None: ...

class StartDraftAssist(_message.Message):
    __slots__ = ("peer_id", "peer_endpoint", "role", "k", "peer_plane_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    PEER_PLANE_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    peer_endpoint: str
    role: str
    k: int
    peer_plane_key: str
    def __init__(self, peer_id: _Optional[str] = ..., peer_endpoint: _Optional[str] = ..., role: _Optional[str] = ..., k: _Optional[int] = ..., peer_plane_key: _Optional[str] = ...) -> None: ...

class StopDraftAssist(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadFrom(_message.Message):
    __slots__ = ("seed_worker_id", "seed_url")
    SEED_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_URL_FIELD_NUMBER: _ClassVar[int]
    seed_worker_id: str
    seed_url: str
    def __init__(self, seed_worker_id: _Optional[str] = ..., seed_url: _Optional[str] = ...) -> None: ...

class PlaneMember(_message.Message):
    __slots__ = ("worker_id", "incarnation", "plane_key", "kv_endpoint", "draft_endpoint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PLANE_KEY_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    plane_key: str
    kv_endpoint: str
    draft_endpoint: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., plane_key: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., draft_endpoint: _Optional[str] = ...) -> None: ...

class Members(_message.Message):
    __slots__ = ("seq", "members", "gateway_keys")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_KEYS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    members: _containers.RepeatedCompositeFieldContainer[PlaneMember]
    gateway_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., members: _Optional[_Iterable[_Union[PlaneMember, _Mapping]]] = ..., gateway_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GatewayMessage(_message.Message):
    __slots__ = ("incarnation", "welcome", "refuse", "assign_holder", "drop_checkpoint", "start_draft_assist", "stop_draft_assist", "drain", "reload_from", "members", "set_admission")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    REFUSE_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_HOLDER_FIELD_NUMBER: _ClassVar[int]
    DROP_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    START_DRAFT_ASSIST_FIELD_NUMBER: _ClassVar[int]
    STOP_DRAFT_ASSIST_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    RELOAD_FROM_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SET_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    welcome: Welcome
    refuse: Refuse
    assign_holder: AssignHolder
    drop_checkpoint: DropCheckpoint
    start_draft_assist: StartDraftAssist
    stop_draft_assist: StopDraftAssist
    drain: Drain
    reload_from: ReloadFrom
    members: Members
    set_admission: SetAdmission
    def __init__(self, incarnation: _Optional[int] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., refuse: _Optional[_Union[Refuse, _Mapping]] = ..., assign_holder: _Optional[_Union[AssignHolder, _Mapping]] = ..., drop_checkpoint: _Optional[_Union[DropCheckpoint, _Mapping]] = ..., start_draft_assist: _Optional[_Union[StartDraftAssist, _Mapping]] = ..., stop_draft_assist: _Optional[_Union[StopDraftAssist, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., reload_from: _Optional[_Union[ReloadFrom, _Mapping]] = ..., members: _Optional[_Union[Members, _Mapping]] = ..., set_admission: _Optional[_Union[SetAdmission, _Mapping]] = ...) -> None: ...

class SetAdmission(_message.Message):
    __slots__ = ("batch_boost", "lease_s", "shortest_first", "shortest_first_rate")
    BATCH_BOOST_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    SHORTEST_FIRST_FIELD_NUMBER: _ClassVar[int]
    SHORTEST_FIRST_RATE_FIELD_NUMBER: _ClassVar[int]
    batch_boost: float
    lease_s: float
    shortest_first: bool
    shortest_first_rate: float
    def __init__(self, batch_boost: _Optional[float] = ..., lease_s: _Optional[float] = ..., shortest_first: _Optional[bool] = ..., shortest_first_rate: _Optional[float] = ...) -> None: ...
