"""Tensor-parallel all-reduce time: a latency term and a ring bandwidth term over one GPU link.

One all-reduce of ``bytes`` over ``n`` GPUs in one node takes

    t = latency_s + hop_latency_s * (n - 1) + 2 (n - 1) / n * bytes / (link_bandwidth * efficiency)

- ``2 (n - 1) / n * bytes`` is what a ring (reduce-scatter then all-gather) sends over each GPU's
  link; ``link_bandwidth`` is the datasheet figure one way per GPU (NVLink: half the bidirectional
  total; PCIe: one direction of x16), ``efficiency`` the fraction NCCL reaches of it.
- ``latency_s`` is the per-call cost (kernel launch, the protocol's handshake) and
  ``hop_latency_s`` what each further GPU adds (a ring has 2 (n - 1) steps; NVSwitch hides most).

The NVLink figures are fitted to Vidur's NCCL all-reduce timings on DGX A100 / H100 nodes
(``../shared/data/gpu/vidur/network/{a100,h100}_dgx/all_reduce.csv``, microsoft/vidur @
7d47513363ec, MIT, (c) Microsoft Corporation) by ``calibration/allreduce_fit.py``
(``python benchmarks/allreduce_vs_nccl.py`` prints the fit and its held-out error). PCIe GPUs
(L40S, RTX) have no public measurement here: the L40S and RTX 4090 take the link's nominal numbers,
the RTX PRO 6000 the link LLMServingSim prices for it (16 GB/s, 20 us; see ``presets.HARDWARE``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .presets import HardwareConfig


@dataclass(frozen=True, slots=True)
class Link:
    """How one GPU reaches its TP peers. Bytes/s one direction; seconds."""

    bandwidth: float
    efficiency: float = 0.7
    latency_s: float = 10e-6
    hop_latency_s: float = 0.0

    @classmethod
    def of(cls, hw: HardwareConfig) -> Link:
        """The hardware preset's interconnect figures."""
        return cls(hw.interconnect_bandwidth, hw.allreduce_efficiency, hw.allreduce_latency_s,
                   hw.allreduce_hop_latency_s)

    def call_s(self, gpus: int) -> float:
        """Seconds of one all-reduce that do not depend on its size (0 on one GPU)."""
        return 0.0 if gpus <= 1 else self.latency_s + self.hop_latency_s * (gpus - 1)

    def per_byte_s(self, gpus: int) -> float:
        """Seconds per byte of message (the ring's bandwidth term; 0 on one GPU)."""
        return 0.0 if gpus <= 1 else ring_factor(gpus) / (self.bandwidth * self.efficiency)

    def seconds(self, nbytes: float | np.ndarray, gpus: int) -> float | np.ndarray:
        """One all-reduce of ``nbytes`` (scalar or array) over ``gpus`` GPUs."""
        if gpus <= 1:
            return nbytes * 0.0
        return self.call_s(gpus) + self.per_byte_s(gpus) * nbytes


def ring_factor(gpus: int) -> float:
    """The share of a message each GPU sends in a ring all-reduce: 2 (n - 1) / n."""
    return 2.0 * (gpus - 1) / gpus
