from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    PALETTE8: _ClassVar[DType]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    FORWARD: _ClassVar[Phase]
    BACKWARD: _ClassVar[Phase]
    STAGE_FORWARD: _ClassVar[Phase]
    STAGE_BACKWARD: _ClassVar[Phase]
    PLACE_KERNELS: _ClassVar[Phase]
    FETCH_KERNELS: _ClassVar[Phase]
    RESIDENT_STAGE_FORWARD: _ClassVar[Phase]
    RESIDENT_STAGE_BACKWARD: _ClassVar[Phase]
    REPLICA_FORWARD: _ClassVar[Phase]
    PUT_PART: _ClassVar[Phase]
    FETCH_PART: _ClassVar[Phase]
    IMAGES_STEP: _ClassVar[Phase]
    RING_PART: _ClassVar[Phase]

class StageLayer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_LAYER_UNSPECIFIED: _ClassVar[StageLayer]
    RELU: _ClassVar[StageLayer]
    LRN: _ClassVar[StageLayer]
    MAXPOOL: _ClassVar[StageLayer]
    AVGPOOL: _ClassVar[StageLayer]
    GLOBAL_AVGPOOL: _ClassVar[StageLayer]
    BATCHNORM: _ClassVar[StageLayer]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
PALETTE8: DType
PHASE_UNSPECIFIED: Phase
FORWARD: Phase
BACKWARD: Phase
STAGE_FORWARD: Phase
STAGE_BACKWARD: Phase
PLACE_KERNELS: Phase
FETCH_KERNELS: Phase
RESIDENT_STAGE_FORWARD: Phase
RESIDENT_STAGE_BACKWARD: Phase
REPLICA_FORWARD: Phase
PUT_PART: Phase
FETCH_PART: Phase
IMAGES_STEP: Phase
RING_PART: Phase
STAGE_LAYER_UNSPECIFIED: StageLayer
RELU: StageLayer
LRN: StageLayer
MAXPOOL: StageLayer
AVGPOOL: StageLayer
GLOBAL_AVGPOOL: StageLayer
BATCHNORM: StageLayer

class TensorHeader(_message.Message):
    __slots__ = ("name", "shape", "dtype", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StageOp(_message.Message):
    __slots__ = ("layer", "size", "alpha", "beta", "k", "kernel", "stride", "eps", "momentum")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    layer: StageLayer
    size: int
    alpha: float
    beta: float
    k: float
    kernel: int
    stride: int
    eps: float
    momentum: float
    def __init__(self, layer: _Optional[_Union[StageLayer, str]] = ..., size: _Optional[int] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., k: _Optional[float] = ..., kernel: _Optional[int] = ..., stride: _Optional[int] = ..., eps: _Optional[float] = ..., momentum: _Optional[float] = ...) -> None: ...

class StageDescription(_message.Message):
    __slots__ = ("ops", "own_start", "own_count", "grad_start", "batchnorm_eval")
    OPS_FIELD_NUMBER: _ClassVar[int]
    OWN_START_FIELD_NUMBER: _ClassVar[int]
    OWN_COUNT_FIELD_NUMBER: _ClassVar[int]
    GRAD_START_FIELD_NUMBER: _ClassVar[int]
    BATCHNORM_EVAL_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[StageOp]
    own_start: int
    own_count: int
    grad_start: int
    batchnorm_eval: bool
    def __init__(self, ops: _Optional[_Iterable[_Union[StageOp, _Mapping]]] = ..., own_start: _Optional[int] = ..., own_count: _Optional[int] = ..., grad_start: _Optional[int] = ..., batchnorm_eval: _Optional[bool] = ...) -> None: ...

class ResidentSlice(_message.Message):
    __slots__ = ("version", "count", "halo_before", "momentum_started", "lr", "momentum", "weight_decay", "head_classes", "fixed_bias")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HALO_BEFORE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_STARTED_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    HEAD_CLASSES_FIELD_NUMBER: _ClassVar[int]
    FIXED_BIAS_FIELD_NUMBER: _ClassVar[int]
    version: int
    count: int
    halo_before: int
    momentum_started: bool
    lr: float
    momentum: float
    weight_decay: float
    head_classes: int
    fixed_bias: bool
    def __init__(self, version: _Optional[int] = ..., count: _Optional[int] = ..., halo_before: _Optional[int] = ..., momentum_started: _Optional[bool] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., head_classes: _Optional[int] = ..., fixed_bias: _Optional[bool] = ...) -> None: ...

class SplitPeer(_message.Message):
    __slots__ = ("address", "start", "count", "master")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    address: str
    start: int
    count: int
    master: bool
    def __init__(self, address: _Optional[str] = ..., start: _Optional[int] = ..., count: _Optional[int] = ..., master: _Optional[bool] = ...) -> None: ...

class SplitBlock(_message.Message):
    __slots__ = ("node", "peers", "round", "prepare")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    node: int
    peers: _containers.RepeatedCompositeFieldContainer[SplitPeer]
    round: int
    prepare: bool
    def __init__(self, node: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[SplitPeer, _Mapping]]] = ..., round: _Optional[int] = ..., prepare: _Optional[bool] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("source", "gradient", "round", "sample", "sample_seed", "missing")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SEED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    source: int
    gradient: bool
    round: int
    sample: int
    sample_seed: int
    missing: bool
    def __init__(self, source: _Optional[int] = ..., gradient: _Optional[bool] = ..., round: _Optional[int] = ..., sample: _Optional[int] = ..., sample_seed: _Optional[int] = ..., missing: _Optional[bool] = ...) -> None: ...

class ImagesStep(_message.Message):
    __slots__ = ("spec_json", "input_shape", "seed", "first", "batch", "scale", "ring", "cut_phase")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    CUT_PHASE_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    first: int
    batch: int
    scale: float
    ring: ImagesRing
    cut_phase: int
    def __init__(self, spec_json: _Optional[str] = ..., input_shape: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., first: _Optional[int] = ..., batch: _Optional[int] = ..., scale: _Optional[float] = ..., ring: _Optional[_Union[ImagesRing, _Mapping]] = ..., cut_phase: _Optional[int] = ...) -> None: ...

class ImagesRing(_message.Message):
    __slots__ = ("peers", "rank", "version", "place", "lr", "momentum", "weight_decay", "master_part", "answer_sum", "wait_seconds", "round", "abort", "bucket_bytes", "digest_seed", "digest_share", "sum_slice", "segment", "segment_bytes", "sum_ports", "sketch")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MASTER_PART_FIELD_NUMBER: _ClassVar[int]
    ANSWER_SUM_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SEED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_SHARE_FIELD_NUMBER: _ClassVar[int]
    SUM_SLICE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUM_PORTS_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[str]
    rank: int
    version: int
    place: bool
    lr: float
    momentum: float
    weight_decay: float
    master_part: bool
    answer_sum: bool
    wait_seconds: float
    round: int
    abort: bool
    bucket_bytes: int
    digest_seed: int
    digest_share: float
    sum_slice: bool
    segment: int
    segment_bytes: int
    sum_ports: _containers.RepeatedScalarFieldContainer[int]
    sketch: bool
    def __init__(self, peers: _Optional[_Iterable[str]] = ..., rank: _Optional[int] = ..., version: _Optional[int] = ..., place: _Optional[bool] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., master_part: _Optional[bool] = ..., answer_sum: _Optional[bool] = ..., wait_seconds: _Optional[float] = ..., round: _Optional[int] = ..., abort: _Optional[bool] = ..., bucket_bytes: _Optional[int] = ..., digest_seed: _Optional[int] = ..., digest_share: _Optional[float] = ..., sum_slice: _Optional[bool] = ..., segment: _Optional[int] = ..., segment_bytes: _Optional[int] = ..., sum_ports: _Optional[_Iterable[int]] = ..., sketch: _Optional[bool] = ...) -> None: ...

class ConvRequest(_message.Message):
    __slots__ = ("phase", "session", "step", "layer", "padding", "kernel_offset", "need_input_grad", "tensors", "answer_dtype", "stage", "resident", "replica_layer", "overlap_images", "split", "part", "images")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    KERNEL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEED_INPUT_GRAD_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LAYER_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_IMAGES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    session: int
    step: int
    layer: str
    padding: _containers.RepeatedScalarFieldContainer[int]
    kernel_offset: int
    need_input_grad: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    answer_dtype: DType
    stage: StageDescription
    resident: ResidentSlice
    replica_layer: str
    overlap_images: int
    split: SplitBlock
    part: TensorPart
    images: ImagesStep
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., session: _Optional[int] = ..., step: _Optional[int] = ..., layer: _Optional[str] = ..., padding: _Optional[_Iterable[int]] = ..., kernel_offset: _Optional[int] = ..., need_input_grad: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., answer_dtype: _Optional[_Union[DType, str]] = ..., stage: _Optional[_Union[StageDescription, _Mapping]] = ..., resident: _Optional[_Union[ResidentSlice, _Mapping]] = ..., replica_layer: _Optional[str] = ..., overlap_images: _Optional[int] = ..., split: _Optional[_Union[SplitBlock, _Mapping]] = ..., part: _Optional[_Union[TensorPart, _Mapping]] = ..., images: _Optional[_Union[ImagesStep, _Mapping]] = ...) -> None: ...

class ConvResult(_message.Message):
    __slots__ = ("compute_seconds", "receive_seconds", "tensors", "timings_follow")
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    compute_seconds: float
    receive_seconds: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    timings_follow: bool
    def __init__(self, compute_seconds: _Optional[float] = ..., receive_seconds: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., timings_follow: _Optional[bool] = ...) -> None: ...

class ConvMessage(_message.Message):
    __slots__ = ("header", "data", "result")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    header: ConvRequest
    data: bytes
    result: ConvResult
    def __init__(self, header: _Optional[_Union[ConvRequest, _Mapping]] = ..., data: _Optional[bytes] = ..., result: _Optional[_Union[ConvResult, _Mapping]] = ...) -> None: ...

class ConvBundle(_message.Message):
    __slots__ = ("header", "data", "result")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    header: ConvRequest
    data: bytes
    result: ConvResult
    def __init__(self, header: _Optional[_Union[ConvRequest, _Mapping]] = ..., data: _Optional[bytes] = ..., result: _Optional[_Union[ConvResult, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("peers", "peer_timeout")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PEER_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedScalarFieldContainer[str]
    peer_timeout: float
    def __init__(self, peers: _Optional[_Iterable[str]] = ..., peer_timeout: _Optional[float] = ...) -> None: ...

class DeviceDescription(_message.Message):
    __slots__ = ("backend", "kind", "name", "memory_bytes", "cores", "hetconv_version", "max_request_bytes", "instance_id", "unreachable", "unreachable_why", "sum_port")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    HETCONV_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_WHY_FIELD_NUMBER: _ClassVar[int]
    SUM_PORT_FIELD_NUMBER: _ClassVar[int]
    backend: str
    kind: str
    name: str
    memory_bytes: int
    cores: int
    hetconv_version: str
    max_request_bytes: int
    instance_id: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    unreachable_why: _containers.RepeatedScalarFieldContainer[str]
    sum_port: int
    def __init__(self, backend: _Optional[str] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., cores: _Optional[int] = ..., hetconv_version: _Optional[str] = ..., max_request_bytes: _Optional[int] = ..., instance_id: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ..., unreachable_why: _Optional[_Iterable[str]] = ..., sum_port: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("n", "c", "h", "w", "k", "kh", "kw", "padding", "repeats", "with_grad_input")
    N_FIELD_NUMBER: _ClassVar[int]
    C_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    KH_FIELD_NUMBER: _ClassVar[int]
    KW_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    WITH_GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    padding: _containers.RepeatedScalarFieldContainer[int]
    repeats: int
    with_grad_input: bool
    def __init__(self, n: _Optional[int] = ..., c: _Optional[int] = ..., h: _Optional[int] = ..., w: _Optional[int] = ..., k: _Optional[int] = ..., kh: _Optional[int] = ..., kw: _Optional[int] = ..., padding: _Optional[_Iterable[int]] = ..., repeats: _Optional[int] = ..., with_grad_input: _Optional[bool] = ...) -> None: ...

class ProbeResult(_message.Message):
    __slots__ = ("seconds", "gflops")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GFLOPS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    gflops: float
    def __init__(self, seconds: _Optional[float] = ..., gflops: _Optional[float] = ...) -> None: ...
