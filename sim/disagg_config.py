"""The ``cluster.disagg`` section: a prefill pool, a decode pool and the KV link between them.

Each pool overrides the scenario's hardware, tensor parallelism, scheduler and KV cache for its
instances (unset fields inherit the scenario's). The link carries a request's KV blocks from the
prefill instance that computed them to the decode instance that continues the request: one copy
per TP rank in parallel, ``latency_s + bytes_per_rank / bandwidth``, one transfer at a time per
prefill instance (its NIC). Presets are per-GPU, one direction, from the datasheets:

- ``nvlink``: NVLink 4 (H100 SXM), 900 GB/s both directions -> 450 GB/s, 5 us;
- ``infiniband``: one ConnectX-7 NDR 400 Gb/s NIC per GPU (GPUDirect RDMA) -> 50 GB/s, 10 us;
- ``pcie``: PCIe Gen4 x16 peer to peer -> 25 GB/s, 10 us;
- ``ethernet``: 100 GbE -> 12.5 GB/s, 50 us.

``bandwidth_gb_s`` (gigabytes per second, 1e9 bytes) and ``latency_s`` override the preset.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .config_model import ConfigModel

RouterName = Literal["round_robin", "least_outstanding", "kv_aware", "least_kv_usage", "power_of_two_choices",
                     "prefix_aware", "vllm_dp"]

LINK_PRESETS: dict[str, tuple[float, float]] = {  # name -> (GB/s per GPU, one direction; latency s)
    "nvlink": (450.0, 5e-6),
    "infiniband": (50.0, 10e-6),
    "pcie": (25.0, 10e-6),
    "ethernet": (12.5, 50e-6),
}


class LinkConfig(ConfigModel):
    """The KV-transfer link from a prefill instance to a decode instance."""

    preset: Literal["nvlink", "infiniband", "pcie", "ethernet"] = "infiniband"
    bandwidth_gb_s: float | None = Field(None, allow_inf_nan=False, description="GB/s per GPU, one direction")
    latency_s: float | None = Field(None, ge=0.0, allow_inf_nan=False, description="seconds per transfer")

    @model_validator(mode="after")
    def _positive_bandwidth(self) -> LinkConfig:
        if self.bandwidth_gb_s is not None and not self.bandwidth_gb_s > 0:
            raise ValueError(f"bandwidth_gb_s must be > 0 GB/s, got {self.bandwidth_gb_s}: a link that moves "
                             "nothing never delivers a request's KV; give a positive bandwidth or a preset")
        return self

    @property
    def bytes_per_s(self) -> float:
        bw = self.bandwidth_gb_s if self.bandwidth_gb_s is not None else LINK_PRESETS[self.preset][0]
        return bw * 1e9

    @property
    def latency(self) -> float:
        return self.latency_s if self.latency_s is not None else LINK_PRESETS[self.preset][1]

    def transfer_seconds(self, total_bytes: float, ranks: int) -> float:
        """Seconds to move ``total_bytes`` of KV split over ``ranks`` parallel GPU links."""
        return self.latency + total_bytes / max(ranks, 1) / self.bytes_per_s


class PoolConfig(ConfigModel):
    """One pool of identical instances; unset fields are the scenario's own."""

    count: int = Field(..., ge=1, description="instances in the pool")
    hardware: str | None = None
    tensor_parallel: int | None = Field(None, ge=1, le=64)
    scheduler: dict[str, Any] | None = None
    kv_cache: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _count_given(cls, data: Any) -> Any:
        count = data.get("count") if isinstance(data, dict) else None
        if type(count) is int and count == 0:  # (False == 0: a boolean is refused as a boolean)
            raise PydanticCustomError("value_error", "count is 0: a disaggregated cluster needs at least one "
                                      "instance in each pool", {"field": "count"})
        return data


class DisaggConfig(ConfigModel):
    """Prefill and decode on separate pools (DistServe, Splitwise, Dynamo, llm-d)."""

    prefill: PoolConfig
    decode: PoolConfig
    link: LinkConfig = Field(default_factory=LinkConfig)
    prefill_router: RouterName = "least_outstanding"
    decode_router: RouterName = "least_kv_usage"
