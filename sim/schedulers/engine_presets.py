"""Engine presets: ``scheduler: {preset: NAME, ...knobs}`` schedules the way that engine does.

Each preset is a pydantic model whose fields are the engine's own knob names, with the engine's
defaults (filled in from the hardware class where the engine does that), and a ``build`` that
maps those knobs onto servesim's building blocks. The mapping lives here and nowhere else:

=================  ===========================================  ====================================
preset             scheduler class and blocks                   knobs (engine names)
=================  ===========================================  ====================================
vllm-v1            ChunkedScheduler (decodes, partial chunks,   max_num_seqs, max_num_batched_tokens,
                   waiting chunks; no admission in a step       long_prefill_token_threshold,
                   that preempted; recompute newest/priority)   max_model_len, policy
vllm-v0            ContinuousScheduler (prefill_first, whole    max_num_seqs, max_num_batched_tokens,
                   prompts, 1% watermark, recompute or swap)    max_model_len, policy, preemption_mode
hf-transformers    ComposedScheduler (fifo: decodes, partial,   scheduler_type, max_batch_tokens,
                   waiting / prefill_first: partial first;      max_requests_per_batch, safety_margin
                   safety margin; stall, soft reset when stuck)
tensorrt-llm       ComposedScheduler (decodes, contexts; GNE:   capacity_scheduler_policy,
                   reserve to completion, never evicts; MAX_    max_batch_size, max_num_tokens,
                   UTILIZATION: pause newest, no admission)     enable_chunked_prefill, max_seq_len
triton-dynamic     DynamicBatcher (static batches by size or    max_batch_size, preferred_batch_size,
                   queue delay)                                 max_queue_delay_microseconds
sglang             RetractingScheduler (prefill-or-decode       schedule_policy, chunked_prefill_size,
                   steps, one chunked request, token-ratio      max_prefill_tokens,
                   admission, retraction; fcfs or lpm)          max_running_requests,
                                                                schedule_conservativeness,
                                                                context_length
=================  ===========================================  ====================================

KV-cache knobs stay in the ``kv_cache`` section under their vLLM names; a preset only changes the
defaults the user did not set (``block_size``: TensorRT-LLM's ``tokens_per_block``, SGLang's
``page_size``, Transformers' ``block_size``; ``enable_prefix_caching``: TensorRT-LLM's
``enable_block_reuse``, SGLang's radix cache, Transformers' ``allow_block_sharing``; ``watermark``:
1% for vLLM V0's block manager, none for the others). Writing one of
those engine names under ``scheduler`` is an error that says where it goes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator

from ..hints import did_you_mean
from ..kv_cache import BlockManager
from ..presets import GiB, HardwareConfig, get_model
from .base import Scheduler, SchedulerConfig
from .chunked import ChunkedScheduler
from .composed import ComposedScheduler, Composition
from .continuous import ContinuousScheduler
from .dynamic_batcher import DynamicBatcher
from .retracting import RetractingScheduler

# Knobs that belong in the kv_cache section, under the names engines give them.
_KV_KNOBS = {
    "block_size": "kv_cache.block_size",
    "tokens_per_block": "kv_cache.block_size",
    "page_size": "kv_cache.block_size",
    "enable_prefix_caching": "kv_cache.enable_prefix_caching",
    "enable_block_reuse": "kv_cache.enable_prefix_caching",
    "allow_block_sharing": "kv_cache.enable_prefix_caching",
    "disable_radix_cache": "kv_cache.enable_prefix_caching (false)",
    "num_blocks": "kv_cache.num_blocks",
    "gpu_memory_utilization": "kv_cache.gpu_memory_utilization",
    "free_gpu_memory_fraction": "kv_cache.gpu_memory_utilization",
    "mem_fraction_static": "kv_cache.gpu_memory_utilization",
    "max_memory_percent": "kv_cache.gpu_memory_utilization",
    "swap_space": "kv_cache.swap_space_gb",
    "watermark": "kv_cache.watermark",
}


class EnginePreset(BaseModel):
    """What every preset shares: knob checking, hardware defaults, the KV defaults it sets, ``build``."""

    model_config = ConfigDict(extra="forbid")

    ENGINE: ClassVar[str] = ""
    MODELLED: ClassVar[str] = ""  # engine version / source modelled (README table)
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {}
    # knob names of other engines (mostly vLLM's) -> what this engine calls them
    RENAMED: ClassVar[dict[str, str]] = {}
    NOT_MODELLED: ClassVar[dict[str, str]] = {}
    VARIANT_KNOB: ClassVar[str | None] = None  # the knob `servesim engines NAME:VALUE` sets

    @model_validator(mode="before")
    @classmethod
    def _known_knobs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        allowed = [k for k in cls.model_fields if k != "preset"]
        for key in data:
            if key == "preset" or key in cls.model_fields:
                continue
            name = data.get("preset", "?")
            if key in cls.RENAMED:
                hint = f"{cls.ENGINE} calls it {cls.RENAMED[key]}"
            elif key in cls.NOT_MODELLED:
                hint = cls.NOT_MODELLED[key]
            elif key in _KV_KNOBS:
                hint = f"KV-cache knobs go in the kv_cache section: set {_KV_KNOBS[key]}"
            elif key == "type":
                hint = "a preset picks its own scheduler; drop 'type'"
            else:
                hint = did_you_mean(key, allowed).strip(" ()") or "not a knob of this preset"
            raise ValueError(f"unknown knob '{key}' for preset {name} ({hint}); its knobs: {', '.join(allowed)}")
        return data

    # ---- what the rest of servesim reads off a scheduler config ----------------------------------
    @property
    def type(self) -> str:
        """The preset's name, where a built-in config has its scheduler type (run header, CLI)."""
        return self.preset  # type: ignore[attr-defined]

    # ---- resolution and construction --------------------------------------------------------
    def resolved(self, hardware: HardwareConfig, model: str) -> EnginePreset:
        """A copy with every knob left unset filled in as the engine would on ``hardware`` for ``model``."""
        return self

    def build(self, block_manager: BlockManager) -> Scheduler:  # pragma: no cover - abstract
        raise NotImplementedError


def _vllm_batch_defaults(hardware: HardwareConfig) -> tuple[int, int]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) for the OpenAI server on this hardware class.

    ``EngineArgs.get_batch_defaults``: devices with >= 70 GiB that are not A100s get 8192 / 1024,
    the rest 2048 / 256 (vLLM measured large budgets to lose throughput on A100, PR #17885).
    """
    if hardware.memory_bytes >= 70 * GiB and "a100" not in hardware.name:
        return 8192, 1024
    return 2048, 256


class VllmV1Preset(EnginePreset):
    """vLLM's V1 engine scheduler (``vllm/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``).

    Modelled on vllm-project/vllm main as stored at commit 00024d3 (the V1 engine since v0.8;
    batch defaults from ``EngineArgs.get_batch_defaults``). One token budget per step; running
    requests first, then waiting ones, chunked prefill always on, ``long_prefill_token_threshold``
    caps one request's chunk; prefix caching on with 16-token blocks; under KV pressure the tail
    of the running queue (or the lowest priority under ``policy: priority``) is preempted by
    recompute, and a step that preempted admits nothing new. No watermark (V1 has none).
    Not modelled: vLLM walks its running list in admission order while servesim serves decodes
    before partial prefills (they differ only when several partial prefills exhaust the budget).
    """

    ENGINE: ClassVar[str] = "vLLM V1"
    MODELLED: ClassVar[str] = "vLLM V1 engine (v0.8+; main @ 00024d3)"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 16, "enable_prefix_caching": True, "watermark": 0.0}
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "enable_chunked_prefill": "V1 always chunks prefills in the version modelled; use preset vllm-v0 "
        "for whole-prompt scheduling",
        "preemption_mode": "V1 preempts by recompute only",
    }
    VARIANT_KNOB: ClassVar[str | None] = "policy"

    preset: Literal["vllm-v1"] = "vllm-v1"
    max_num_seqs: int | None = Field(None, ge=1, description="default by hardware: 1024 (>= 70 GiB, not A100) else 256")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="default by hardware: 8192 or 2048")
    long_prefill_token_threshold: int = Field(0, ge=0, description="cap on one request's prefill tokens per step")
    max_model_len: int | None = Field(None, ge=1)
    policy: Literal["fcfs", "priority"] = "fcfs"

    @property
    def preemption_mode(self) -> str:
        return "recompute"

    def resolved(self, hardware: HardwareConfig, model: str) -> VllmV1Preset:
        tokens, seqs = _vllm_batch_defaults(hardware)
        return self.model_copy(update={
            "max_num_batched_tokens": self.max_num_batched_tokens or tokens,
            "max_num_seqs": self.max_num_seqs or seqs,
        })

    def build(self, block_manager: BlockManager) -> Scheduler:
        cfg = SchedulerConfig(
            type="chunked", max_num_seqs=self.max_num_seqs or 256, max_num_batched_tokens=self.max_num_batched_tokens
            or 2048, long_prefill_token_threshold=self.long_prefill_token_threshold, max_model_len=self.max_model_len,
            policy=self.policy, preemption_mode="recompute",
        )
        return ChunkedScheduler(cfg, block_manager)


class VllmV0Preset(EnginePreset):
    """vLLM's V0 scheduler with chunked prefill off (``vllm/core/scheduler.py``, ``_schedule_default``).

    Modelled on vLLM v0.6 (the V0 engine up to v0.10). Prefill-prioritised continuous batching:
    whenever a whole prompt can be admitted (token budget, ``max_num_seqs``, and the block
    manager's 1% watermark) the step prefills only; otherwise every running request decodes;
    swapped requests come back before any new prompt. Preemption by recompute (default) or swap,
    newest first. With chunking off vLLM sets ``max_num_batched_tokens = max(max_model_len,
    2048)``, ``max_model_len`` being the model's context length. No prefix caching by default.
    Not modelled: vLLM v0.6's OpenAI server turned chunked prefill on for contexts over 32k
    (this preset is the chunking-off path); beam search / n > 1 sequence groups.
    """

    ENGINE: ClassVar[str] = "vLLM V0"
    MODELLED: ClassVar[str] = "vLLM V0 scheduler (v0.6.x, chunked prefill off)"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 16, "enable_prefix_caching": False, "watermark": 0.01}
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "enable_chunked_prefill": "this preset is V0 with chunked prefill off; use preset vllm-v1 or "
        "scheduler.type: chunked for chunked prefill",
        "long_prefill_token_threshold": "V0 without chunked prefill schedules whole prompts",
    }
    VARIANT_KNOB: ClassVar[str | None] = "preemption_mode"

    preset: Literal["vllm-v0"] = "vllm-v0"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1, description="default max(max_model_len, 2048)")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context length")
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"

    def resolved(self, hardware: HardwareConfig, model: str) -> VllmV0Preset:
        max_len = self.max_model_len or get_model(model).max_position_embeddings
        return self.model_copy(update={
            "max_model_len": max_len,
            "max_num_batched_tokens": self.max_num_batched_tokens or max(max_len, 2048),
        })

    def build(self, block_manager: BlockManager) -> Scheduler:
        cfg = SchedulerConfig(
            type="continuous", max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens
            or 2048, max_model_len=self.max_model_len, policy=self.policy, preemption_mode=self.preemption_mode,
            schedule_order="prefill_first",
        )
        return ContinuousScheduler(cfg, block_manager)


class TransformersPreset(EnginePreset):
    """Hugging Face Transformers' continuous batching (``generation/continuous_batching``: ``scheduler.py``,
    ``continuous_api.py``, ``offloading_manager.py``; ``ContinuousBatchingConfig`` defaults).

    Modelled on transformers v5 (docs v5.17; scheduler.py at 9f84789/57434398 as stored). ``fifo``:
    decoding requests first, then partly prefilled ones, then waiting ones, each taking up to what
    is left of ``max_batch_tokens`` (prompts are chunked by the budget); once free blocks are under
    ``safety_margin`` of the cache (judged at the start of the step) only decodes run, or a single
    prefill if nothing else can. ``prefill_first``: partly prefilled requests before decodes, no
    margin. A request that cannot get a block sits the step out; a waiting one that does not fit is
    passed over for a later one. If no request at all can run, one is soft reset (its generated
    tokens folded into its prompt, blocks freed, back to the end of the queue): the oldest while
    admissions are open, the newest once they are blocked, and admissions stay blocked until a
    request finishes. 256-token blocks with prefix sharing. At most ``max_requests_per_batch``
    requests per step; the number holding KV is bounded only by the cache.
    Not modelled: CPU offloading (``cpu_offload_space``, off by default), the v5 "stalled requests"
    offload path, the per-pass cache-read budget, CUDA-graph padding. transformers v4.56-4.57 used
    ``safety_margin`` 0.2 for fifo (set it to reproduce those releases).
    """

    ENGINE: ClassVar[str] = "Transformers"
    MODELLED: ClassVar[str] = "Transformers continuous batching (v5.x ContinuousBatchingManager)"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 256, "enable_prefix_caching": True, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_batched_tokens": "max_batch_tokens",
        "max_num_seqs": "max_requests_per_batch",
        "scheduler": "scheduler_type",
        "policy": "scheduler_type",
    }
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "cpu_offload_space": "CPU offloading is not modelled; requests are soft reset instead",
    }
    VARIANT_KNOB: ClassVar[str | None] = "scheduler_type"

    preset: Literal["hf-transformers"] = "hf-transformers"
    scheduler_type: Literal["fifo", "prefill_first"] = "fifo"
    max_batch_tokens: int = Field(8192, ge=1, description="token budget of one forward pass")
    max_requests_per_batch: int = Field(1024, ge=1, description="requests in one forward pass")
    safety_margin: float | None = Field(None, ge=0.0, le=1.0, description="default 0.15 (fifo), 0.0 (prefill_first)")

    @property
    def preemption_mode(self) -> str:
        return "soft_reset"

    def resolved(self, hardware: HardwareConfig, model: str) -> TransformersPreset:
        margin = self.safety_margin
        if margin is None:
            margin = 0.15 if self.scheduler_type == "fifo" else 0.0
        return self.model_copy(update={"safety_margin": margin})

    def build(self, block_manager: BlockManager) -> Scheduler:
        margin = self.safety_margin if self.safety_margin is not None else 0.15
        fifo = self.scheduler_type == "fifo"
        comp = Composition(
            order=("decode", "partial") if fifo else ("partial", "decode"),
            chunked=True,
            admission="safety_margin" if margin > 0 else "free_blocks",
            safety_margin=margin,
            skip_unfit_waiting=True,
            on_kv_shortage="stall",
            victim="oldest_then_newest",
            requeue="tail",
            admit_after_preemption="not_until_a_finish",
            max_rows_per_step=self.max_requests_per_batch,
        )
        # Every request holding KV holds at least one block: that bounds how many can be active.
        cfg = SchedulerConfig(
            type="chunked", max_num_seqs=max(block_manager.num_blocks, 1), max_num_batched_tokens=self.max_batch_tokens,
            preemption_mode="soft_reset",
        )
        return ComposedScheduler(cfg, block_manager, comp)


class TensorRTLLMPreset(EnginePreset):
    """TensorRT-LLM's in-flight batching: capacity scheduler + micro-batch scheduler
    (``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``, ``tensorrt_llm/_torch/pyexecutor/scheduler.py``).

    Modelled on TensorRT-LLM 1.x (llm_args ``SchedulerConfig``/``KvCacheConfig`` defaults as stored).
    Context and generation requests share a step: generation requests one token each, then
    contexts, within ``max_num_tokens`` and ``max_batch_size``; without ``enable_chunked_prefill``
    (the default) a context runs only whole, and a prompt longer than ``max_num_tokens`` is
    rejected; with it, contexts are cut first-come-first-served at KV-block boundaries.
    ``GUARANTEED_NO_EVICT`` (default) starts a request only if the blocks for its prompt plus its
    whole output are free after every running request's own remaining need, in arrival order
    (head-of-line), and so never evicts. ``MAX_UTILIZATION`` admits whatever fits the next step
    and, short of blocks, pauses the latest-arrived running request (its KV freed, its generated
    tokens kept as prompt, back to the head of the queue); a step that paused admits nothing new.
    32-token blocks with block reuse.
    Not modelled: a paused request reclaiming its place ahead of newer running ones, the
    ``EQUAL_PROGRESS`` chunking policy, ``STATIC_BATCH``, KV-cache offload to host, beam width > 1.
    """

    ENGINE: ClassVar[str] = "TensorRT-LLM"
    MODELLED: ClassVar[str] = "TensorRT-LLM 1.x capacity + micro-batch scheduler"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 32, "enable_prefix_caching": True, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_seqs": "max_batch_size",
        "max_num_batched_tokens": "max_num_tokens",
        "max_model_len": "max_seq_len",
        "scheduler_policy": "capacity_scheduler_policy",
        "policy": "capacity_scheduler_policy",
    }
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "context_chunking_policy": "only FIRST_COME_FIRST_SERVED chunking is modelled (the default)",
    }
    VARIANT_KNOB: ClassVar[str | None] = "capacity_scheduler_policy"

    preset: Literal["tensorrt-llm"] = "tensorrt-llm"
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = "GUARANTEED_NO_EVICT"
    max_batch_size: int = Field(2048, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    enable_chunked_prefill: bool = False
    max_seq_len: int | None = Field(None, ge=1)

    @property
    def preemption_mode(self) -> str:
        return "soft_reset" if self.capacity_scheduler_policy == "MAX_UTILIZATION" else "recompute"

    def build(self, block_manager: BlockManager) -> Scheduler:
        no_evict = self.capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
        comp = Composition(
            order=("decode", "partial"),
            chunked=self.enable_chunked_prefill,
            chunk_unit=block_manager.block_size,
            admission="reserve_to_completion" if no_evict else "free_blocks",
            on_kv_shortage="preempt",
            victim="latest_arrival",
            requeue="head",
            admit_after_preemption="not_this_step",
        )
        # A pause keeps what was generated as prompt: soft reset arithmetic, back at the head.
        cfg = SchedulerConfig(
            type="chunked", max_num_seqs=self.max_batch_size, max_num_batched_tokens=self.max_num_tokens,
            max_model_len=self.max_seq_len, preemption_mode=self.preemption_mode,
        )
        return ComposedScheduler(cfg, block_manager, comp)


class TritonDynamicPreset(EnginePreset):
    """Triton Inference Server's dynamic batcher serving a stateless generate model
    (``docs/user_guide/batcher.md``: preferred batch sizes, delayed batching).

    Modelled on Triton Inference Server 2.x (r24/r25 docs). When the model instance is free, a
    batch of the queued requests goes at once if ``max_batch_size`` of them (or one of the
    ``preferred_batch_size`` sizes, the largest that can be formed) are waiting; otherwise the
    batcher waits until the oldest has been queued ``max_queue_delay_microseconds`` and sends what
    is there (0, Triton's default, means no wait). The batch runs to its longest member with no one
    joining (a stateless model generates the whole batch in one execution), each member's prompt
    and output reserved up front. Triton has no default ``max_batch_size`` (it is the model's
    config); servesim uses 16.
    Not modelled: padding every member to the longest sequence (a real stateless model wastes that
    KV and compute), non-streaming responses held until the batch ends (servesim times each
    request's tokens as they are produced), several model instances, queue priorities and timeouts.
    """

    ENGINE: ClassVar[str] = "Triton dynamic batcher"
    MODELLED: ClassVar[str] = "Triton Inference Server 2.x dynamic batcher"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 16, "enable_prefix_caching": False, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_seqs": "max_batch_size",
        "preferred_batch_sizes": "preferred_batch_size",
        "max_queue_delay_us": "max_queue_delay_microseconds",
    }

    preset: Literal["triton-dynamic"] = "triton-dynamic"
    max_batch_size: int = Field(16, ge=1)
    preferred_batch_size: list[int] = Field(default_factory=list)
    max_queue_delay_microseconds: int = Field(0, ge=0)

    @property
    def preemption_mode(self) -> str:
        return "recompute"  # static batches reserve everything up front: never preempted

    @model_validator(mode="after")
    def _preferred_within_max(self) -> TritonDynamicPreset:
        bad = [p for p in self.preferred_batch_size if not 1 <= p <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_size {bad} must lie in 1..max_batch_size ({self.max_batch_size})")
        return self

    def build(self, block_manager: BlockManager) -> Scheduler:
        cfg = SchedulerConfig(type="static", max_num_seqs=self.max_batch_size)
        return DynamicBatcher(
            cfg, block_manager, max_queue_delay_s=self.max_queue_delay_microseconds * 1e-6,
            preferred_batch_sizes=tuple(self.preferred_batch_size),
        )


def _sglang_chunked_prefill_size(hardware: HardwareConfig) -> int:
    """``ServerArgs``' default by GPU memory: < 35 GiB 2048, < 60 GiB 4096, < 160 GiB 8192, else 16384."""
    mem = hardware.memory_bytes
    if mem < 35 * GiB:
        return 2048
    if mem < 60 * GiB:
        return 4096
    if mem < 160 * GiB:
        return 8192
    return 16384


class SGLangPreset(EnginePreset):
    """SGLang's scheduler (``managers/scheduler.py``, ``schedule_policy.py`` ``PrefillAdder``,
    ``schedule_batch.py`` ``retract_decode``; constants from ``global_config.py``).

    Modelled on SGLang v0.4.9-v0.5 (schedule_policy.py at 00550cd as stored). A step is a prefill
    step whenever something can be prefilled, else a decode step of every running request (no mixed
    steps). Prefill: the one partly prefilled request continues, then waiting requests in ``fcfs``
    or ``lpm`` order (most cached prompt tokens first; fcfs above 128 waiting; requests sharing an
    uncached prefix with an earlier one wait a round) while ``chunked_prefill_size`` tokens and the
    KV estimate allow: free tokens minus ``min(outputs left, 4096) * new_token_ratio`` per running
    request must exceed a newcomer's prompt + ``min(max output, 4096)``. Decode out of KV: retract
    the requests with the fewest outputs (longest prompt among equals) until 20 tokens per request
    are free; they are recomputed later from the back of the queue. Radix-cache prefix reuse (through
    servesim's block hash chain) with page size 1. ``max_running_requests`` defaults to
    ``min(max(pool tokens / context length * 512, 2048), 4096)``.
    Not modelled: ``--enable-mixed-chunk``, caching of generated tokens for later turns (the radix
    tree stores outputs too; servesim caches prompt blocks only), hierarchical cache, priority
    scheduling, the overlap scheduler's one-step lag.
    """

    ENGINE: ClassVar[str] = "SGLang"
    MODELLED: ClassVar[str] = "SGLang v0.4.9-v0.5 scheduler"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 1, "enable_prefix_caching": True, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_seqs": "max_running_requests",
        "max_num_batched_tokens": "chunked_prefill_size",
        "policy": "schedule_policy",
        "max_model_len": "context_length",
    }
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "enable_mixed_chunk": "mixed prefill + decode steps are not modelled (SGLang's default is off)",
    }
    VARIANT_KNOB: ClassVar[str | None] = "schedule_policy"

    preset: Literal["sglang"] = "sglang"
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    chunked_prefill_size: int | None = Field(None, description="default by GPU memory; -1 turns chunking off")
    max_prefill_tokens: int = Field(16384, ge=1)
    max_running_requests: int | None = Field(None, ge=1)
    schedule_conservativeness: float = Field(1.0, ge=0.0)
    context_length: int | None = Field(None, ge=1)

    # the model's context length, set by ``resolved``: the default max_running_requests needs it
    _context: int = PrivateAttr(4096)

    @property
    def preemption_mode(self) -> str:
        return "recompute"  # a retracted request is recomputed

    def resolved(self, hardware: HardwareConfig, model: str) -> SGLangPreset:
        out = self.model_copy(update={
            "chunked_prefill_size": self.chunked_prefill_size or _sglang_chunked_prefill_size(hardware),
        })
        out._context = self.context_length or get_model(model).max_position_embeddings
        return out

    def build(self, block_manager: BlockManager) -> Scheduler:
        chunk = self.chunked_prefill_size or 8192
        chunked = chunk > 0
        running = self.max_running_requests
        if running is None:
            pool = block_manager.num_blocks * block_manager.block_size
            running = min(max(int(pool / (self.context_length or self._context) * 512), 2048), 4096)
        cfg = SchedulerConfig(
            type="chunked", max_num_seqs=running, max_num_batched_tokens=chunk if chunked else self.max_prefill_tokens,
            max_model_len=self.context_length, preemption_mode="recompute",
        )
        return RetractingScheduler(
            cfg, block_manager, waiting_order=self.schedule_policy, max_prefill_tokens=self.max_prefill_tokens,
            chunked=chunked, conservativeness=self.schedule_conservativeness,
        )


PRESETS: dict[str, type[EnginePreset]] = {
    "vllm-v1": VllmV1Preset,
    "vllm-v0": VllmV0Preset,
    "hf-transformers": TransformersPreset,
    "tensorrt-llm": TensorRTLLMPreset,
    "triton-dynamic": TritonDynamicPreset,
    "sglang": SGLangPreset,
}


# ---- the scheduler section of a scenario ------------------------------------------------------------
BUILTIN_TAG = "builtin"  # a section without ``preset``: one of servesim's own schedulers
_UNKNOWN_TAG = "preset"  # so an unknown name reports as "scheduler.preset: ..."


class _UnknownPreset(BaseModel):
    """Validates nothing: names the bad preset and the ones there are."""

    @model_validator(mode="before")
    @classmethod
    def _reject(cls, data: Any) -> Any:
        name = data.get("preset") if isinstance(data, dict) else data
        raise ValueError(f"unknown engine preset {name!r}{did_you_mean(name, PRESETS)}; choose one of: "
                         f"{', '.join(PRESETS)}")


def _section_tag(value: Any) -> str:
    preset = value.get("preset") if isinstance(value, dict) else getattr(value, "preset", None)
    if preset is None:
        return BUILTIN_TAG
    return preset if preset in PRESETS else _UNKNOWN_TAG


SchedulerSection = Annotated[
    Union[  # noqa: UP007 - built from the preset table
        tuple(
            [Annotated[SchedulerConfig, Tag(BUILTIN_TAG)]]
            + [Annotated[cls, Tag(name)] for name, cls in PRESETS.items()]
            + [Annotated[_UnknownPreset, Tag(_UNKNOWN_TAG)]]
        )
    ],
    Discriminator(_section_tag),
]
"""A scenario's ``scheduler``: a built-in ``SchedulerConfig``, or an engine preset picked by ``preset``."""


def apply_preset_defaults(scheduler: Any, hardware: HardwareConfig, model: str, kv_cache: BaseModel) -> Any:
    """Resolve a preset's hardware defaults and set its KV defaults on fields the user left unset.

    Returns the (possibly new) scheduler config; ``kv_cache`` is updated in place.
    """
    if not isinstance(scheduler, EnginePreset):
        return scheduler
    for name, value in scheduler.KV_DEFAULTS.items():
        if name not in kv_cache.model_fields_set:
            setattr(kv_cache, name, value)
    return scheduler.resolved(hardware, model)
