"""The TP all-reduce model (sim/allreduce.py) alone and inside the roofline, and its fit to NCCL."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from servesim.sim.allreduce import Link, ring_factor
from servesim.sim.batch import step_sums
from servesim.sim.cost_model import RooflineCostModel
from servesim.sim.presets import get_hardware, get_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu" / "vidur" / "network"
I64 = np.int64


def test_ring_all_reduce_sends_two_n_minus_one_over_n_of_the_message():
    link = Link(bandwidth=100e9, efficiency=0.5, latency_s=10e-6, hop_latency_s=1e-6)
    assert ring_factor(2) == 1.0 and ring_factor(8) == 1.75
    assert link.seconds(50e6, 8) == pytest.approx(10e-6 + 7e-6 + 1.75 * 50e6 / 50e9)
    assert link.seconds(50e6, 1) == 0.0


def test_one_call_costs_more_on_more_gpus_at_any_size():
    link = Link.of(get_hardware("h100-sxm"))
    for size in (2e3, 1e6, 64e6):
        t = [link.seconds(size, n) for n in (2, 4, 8)]
        assert t[0] < t[1] < t[2]


@pytest.mark.parametrize("hw", ["h100-sxm", "a100-80g", "l40s"])
def test_tp2_is_never_priced_as_exactly_half_of_tp1(hw):
    model, hardware = get_model("llama-3.1-70b"), get_hardware(hw)
    one, two = (RooflineCostModel(model, hardware, tp) for tp in (1, 2))
    shapes = [(np.ones(b, I64), np.full(b, ctx, I64)) for b in (1, 8, 64, 256) for ctx in (128, 4096)]
    shapes += [(np.array([t], I64), np.zeros(1, I64)) for t in (16, 512, 2048, 8192)]
    for q, ctx in shapes:
        t1, t2 = one.iteration_time(q, ctx), two.iteration_time(q, ctx)
        comm = two.breakdown(step_sums(q, ctx))["all_reduce"]
        assert comm > 0 and t2 > t1 / 2, (hw, q.sum(), t1, t2)


def test_a_slower_link_makes_tensor_parallel_steps_slower():
    model, h100 = get_model("llama-3.1-70b"), get_hardware("h100-sxm")
    q, ctx = np.array([2048], I64), np.zeros(1, I64)
    nvlink = RooflineCostModel(model, h100, 4).iteration_time(q, ctx)
    pcie = RooflineCostModel(model, replace(h100, interconnect_bandwidth=25e9), 4).iteration_time(q, ctx)
    assert pcie > nvlink * 1.2


def test_gpus_with_measured_nccl_carry_the_fitted_link():
    for name in ("h100-sxm", "h200"):
        hw = get_hardware(name)
        assert (hw.interconnect, hw.allreduce_efficiency) == ("nvlink4", 0.727)
    assert get_hardware("a100-80g").interconnect == "nvlink3"
    assert get_hardware("l40s").interconnect.startswith("pcie")


@pytest.mark.skipif(not DATA.is_dir(), reason="public NCCL measurements not present")
@pytest.mark.parametrize("cluster,hw,median,p90", [("h100_dgx", "h100-sxm", 0.08, 0.15),
                                                   ("a100_dgx", "a100-80g", 0.13, 0.20)])
def test_fit_predicts_held_out_message_sizes_within_tolerance(cluster, hw, median, p90):
    """Held-out quarter of the sizes, messages >= 1 MiB (prefill-sized): median and p90 APE bounds."""
    from servesim.calibration.allreduce_fit import fit_allreduce

    fit = fit_allreduce(DATA / cluster / "all_reduce.csv", get_hardware(hw).interconnect_bandwidth)
    big = fit.held_out[fit.held_out["bytes"] >= 1 << 20]
    assert len(big) > 300
    assert big["ape"].median() <= median and big["ape"].quantile(0.9) <= p90
    # the shipped preset is this fit, rounded
    link = Link.of(get_hardware(hw))
    assert link.efficiency == pytest.approx(fit.link.efficiency, abs=1e-3)
    assert link.latency_s == pytest.approx(fit.link.latency_s, abs=0.1e-6)
    assert link.hop_latency_s == pytest.approx(fit.link.hop_latency_s, abs=0.01e-6)
