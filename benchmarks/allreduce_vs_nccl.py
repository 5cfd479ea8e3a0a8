"""The TP all-reduce model against Vidur's NCCL measurements: fitted constants and held-out error.

    python benchmarks/allreduce_vs_nccl.py [DATA_DIR]

For the DGX A100 and H100 files in ``DATA_DIR/vidur/network/`` (default ``../shared/data/gpu``;
microsoft/vidur @ 7d47513363ec, MIT, (c) Microsoft Corporation), fits ``sim.allreduce.Link`` on
three quarters of the message sizes (``calibration/allreduce_fit.py``) and prints the constants
(the figures ``sim/presets.py`` carries for a100-80g / h100-sxm / h200) and the error on the
held-out quarter per size band and GPU count, next to what the preset's constants predict.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from servesim.calibration.allreduce_fit import fit_allreduce, held_out_mask, node_rows
from servesim.sim.allreduce import Link
from servesim.sim.presets import get_hardware

CLUSTERS = {"a100_dgx": "a100-80g", "h100_dgx": "h100-sxm"}


def main(data: Path) -> None:
    for cluster, hw_name in CLUSTERS.items():
        path = data / "vidur" / "network" / cluster / "all_reduce.csv"
        hw = get_hardware(hw_name)
        fit = fit_allreduce(path, hw.interconnect_bandwidth)
        ln = fit.link
        print(f"{cluster} ({path}) vs {hw_name} link {hw.interconnect_bandwidth / 1e9:.0f} GB/s:")
        print(f"  fit:    latency {ln.latency_s * 1e6:.1f} us + {ln.hop_latency_s * 1e6:.2f} us per further GPU, "
              f"efficiency {ln.efficiency:.3f} ({ln.bandwidth * ln.efficiency / 1e9:.0f} GB/s)")
        print(fit.error_table().to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        df = node_rows(path)
        df = df[held_out_mask(df["bytes"])]
        preset = Link.of(hw)
        pred = np.array([preset.seconds(b, int(n)) for b, n in zip(df["bytes"], df["gpus"], strict=True)])
        ape = np.abs(pred - df["seconds"].to_numpy()) / df["seconds"].to_numpy()
        big = df["bytes"].to_numpy() >= 1 << 20
        print(f"  preset constants on the held-out sizes >= 1 MiB: median APE {np.median(ape[big]):.3f}, "
              f"p90 {np.quantile(ape[big], 0.9):.3f}; < 1 MiB: median {np.median(ape[~big]):.3f}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu")
