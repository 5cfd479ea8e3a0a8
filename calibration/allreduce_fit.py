"""Fit ``sim.allreduce.Link`` (latency, per-hop latency, bandwidth efficiency) to measured NCCL
all-reduces, and score it on message sizes the fit never saw.

Input: Vidur's ``network/<cluster>/all_reduce.csv`` (``importers.vidur.read_all_reduce``), one
node only (``num_workers == devices_per_node``: TP stays inside a node), 2 to 8 GPUs. Every
``HOLDOUT_EVERY``-th distinct message size (from the ``HOLDOUT_OFFSET``-th on) is held out; the rest are fitted by
non-negative least squares on relative error (rows weighted by 1 / measured time), so small and
large messages count alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from ..sim.allreduce import Link, ring_factor
from .importers.vidur import read_all_reduce

HOLDOUT_EVERY = 4
HOLDOUT_OFFSET = 2
# message-size bands the held-out error is reported in (bytes): decode-sized, prefill-sized, large
BANDS = ((0, 1 << 20), (1 << 20, 16 << 20), (16 << 20, 1 << 40))


@dataclass(frozen=True, slots=True)
class AllReduceFit:
    link: Link
    held_out: pd.DataFrame  # bytes, gpus, measured_s, predicted_s, ape
    source: str

    def error_table(self) -> pd.DataFrame:
        """Median and p90 absolute percentage error on the held-out sizes, per size band and GPU count."""
        rows = []
        for lo, hi in BANDS:
            band = self.held_out[(self.held_out["bytes"] >= lo) & (self.held_out["bytes"] < hi)]
            for gpus, g in [("all", band), *band.groupby("gpus")]:
                rows.append({"bytes_from": lo, "bytes_to": hi, "gpus": gpus, "n": len(g),
                             "median_ape": float(g["ape"].median()), "p90_ape": float(g["ape"].quantile(0.9))})
        return pd.DataFrame(rows)


def node_rows(path: str | Path, max_gpus: int = 8) -> pd.DataFrame:
    """The single-node rows of an ``all_reduce.csv``: bytes, gpus, seconds."""
    df, _ = read_all_reduce(path)
    df = df[(df["num_workers"] == df["devices_per_node"]) & (df["num_workers"] <= max_gpus)
            & (df["num_workers"] > 1)]
    return df.rename(columns={"num_workers": "gpus"})[["bytes", "gpus", "seconds"]].reset_index(drop=True)


def held_out_mask(sizes: pd.Series) -> np.ndarray:
    """True for the rows whose message size is held out (every HOLDOUT_EVERY-th distinct size)."""
    distinct = np.sort(sizes.unique())
    return sizes.isin(set(distinct[HOLDOUT_OFFSET::HOLDOUT_EVERY].tolist())).to_numpy()


def fit_allreduce(path: str | Path, link_bandwidth: float) -> AllReduceFit:
    """Fit latency, hop latency and efficiency of a link of ``link_bandwidth`` bytes/s to ``path``."""
    df = node_rows(path)
    held = held_out_mask(df["bytes"])
    gpus = df["gpus"].to_numpy()
    size = df["bytes"].to_numpy(dtype=np.float64)
    t = df["seconds"].to_numpy(dtype=np.float64)
    ring = np.array([ring_factor(int(n)) for n in gpus])
    x = np.column_stack([np.ones_like(size), gpus - 1.0, ring * size])
    w = 1.0 / t
    coef, _ = nnls(x[~held] * w[~held, None], t[~held] * w[~held])
    link = Link(link_bandwidth, efficiency=float(1.0 / (coef[2] * link_bandwidth)), latency_s=float(coef[0]),
                hop_latency_s=float(coef[1]))
    pred = np.array([link.seconds(b, int(n)) for b, n in zip(size[held], gpus[held], strict=True)])
    out = pd.DataFrame({"bytes": size[held].astype(np.int64), "gpus": gpus[held], "measured_s": t[held],
                        "predicted_s": pred})
    out["ape"] = (out["predicted_s"] - out["measured_s"]).abs() / out["measured_s"]
    return AllReduceFit(link, out, str(path))
