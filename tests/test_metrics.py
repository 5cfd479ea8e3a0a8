"""Metrics: recorder columns, hand-computed summaries, goodput, JSON, the ITL histogram, plots."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pandas as pd
import pytest
from servesim.sim import plots
from servesim.sim.batch import Batch
from servesim.sim.metrics import (
    ITERATION_COLUMNS,
    REQUEST_COLUMNS,
    LogHistogram,
    MetricsRecorder,
    format_summary_table,
    load_run,
    meets_slo,
    summarize,
    to_json,
    write_run,
)
from servesim.sim.plots import MAX_REPLICA_LINES, plot_cdf_overlay, plot_latency_vs_rate, plot_run
from servesim.sim.request import Request, RequestState

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _finished(rid, arrival, ttft, e2e, out, preemptions=0, prompt=100):
    r = Request(request_id=rid, arrival_time=arrival, prompt_len=prompt, output_len=out)
    r.state = RequestState.FINISHED
    r.first_scheduled_time = arrival + 0.05
    r.first_token_time = arrival + ttft
    r.finish_time = arrival + e2e
    r.num_output_tokens = out
    r.num_preemptions = preemptions
    r.replica = 0
    return r


def _rejected(rid, arrival):
    r = Request(request_id=rid, arrival_time=arrival, prompt_len=9000, output_len=10)
    r.state = RequestState.REJECTED
    r.reject_reason = "prompt longer than the KV cache"
    # Garbage timestamps must not leak into latency statistics.
    r.first_token_time = arrival + 99.0
    r.finish_time = arrival + 99.0
    return r


def _recorder_with_four_requests(with_rejected=True):
    """ttft 100/200/300/400 ms; tpot 100/50/-/200 ms; e2e 1100/700/300/4400 ms; last finish 7.4 s."""
    rec = MetricsRecorder()
    rec.on_request_done(_finished(0, 0.0, 0.1, 1.1, 11))
    rec.on_request_done(_finished(1, 1.0, 0.2, 0.7, 11, preemptions=2))
    rec.on_request_done(_finished(2, 2.0, 0.3, 0.3, 1))
    rec.on_request_done(_finished(3, 3.0, 0.4, 4.4, 21, preemptions=1))
    if with_rejected:
        rec.on_request_done(_rejected(4, 0.5))
    return rec


def _batch(new, ctx, samples):
    new = np.asarray(new, dtype=np.int64)
    reqs = [Request(i, 0.0, 10, 10) for i in range(len(new))]
    return Batch.of(reqs, new, np.asarray(ctx, dtype=np.int64), np.asarray(samples, dtype=bool))


@pytest.mark.parametrize("order", [None, np.array([4, 3, 2, 1, 0])])
def test_requests_frame_never_writes_through_to_the_recorded_columns(order):
    rec = _recorder_with_four_requests()
    before = {k: v.copy() for k, v in rec.request_columns().items()}
    df = rec.requests_frame(order)
    for col in ("prompt_len", "arrival_time", "finish_time", "num_preemptions"):
        df.loc[0, col] = -7
    after = rec.request_columns()
    for k, v in before.items():
        assert np.array_equal(after[k], v, equal_nan=v.dtype.kind == "f"), k
    assert rec.requests_frame(order)["prompt_len"].iloc[0] != -7


def test_requests_frame_can_release_the_records_it_reorders():
    """finish_run's frame takes the recorder's columns over (release): the same frame, and the
    records are gone afterwards, loudly, rather than read half-empty."""
    order = np.array([4, 3, 2, 1, 0])
    kept = _recorder_with_four_requests().requests_frame(order)
    rec = _recorder_with_four_requests()
    released = rec.requests_frame(order, release=True)
    pd.testing.assert_frame_equal(released, kept, check_exact=True)
    assert all(not chunks for chunks in rec._req_cols.values())
    with pytest.raises(RuntimeError, match="release=True"):
        rec.request_columns()


def test_requests_frame_derives_latencies_per_request():
    df = _recorder_with_four_requests().requests_frame()
    assert tuple(df.columns) == REQUEST_COLUMNS
    assert df["ttft"].iloc[:4].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert df["e2e"].iloc[:4].tolist() == pytest.approx([1.1, 0.7, 0.3, 4.4])
    assert df["queueing_delay"].iloc[:4].tolist() == pytest.approx([0.05] * 4)
    assert df["tpot"].iloc[[0, 1, 3]].tolist() == pytest.approx([0.1, 0.05, 0.2])
    assert math.isnan(df["tpot"].iloc[2])  # one output token: no TPOT
    assert df["state"].tolist() == ["finished"] * 4 + ["rejected"]
    assert df["reject_reason"].iloc[4] == "prompt longer than the KV cache"


def test_summary_matches_hand_computed_statistics():
    rec = _recorder_with_four_requests()
    s = summarize(rec.requests_frame(), rec.iterations_frame(), rec.itl_histogram)
    assert s["completed"] == 4 and s["rejected"] == 1
    assert s["duration_s"] == pytest.approx(7.4)
    assert s["total_input_tokens"] == 400 and s["total_output_tokens"] == 44
    assert s["request_throughput"] == pytest.approx(4 / 7.4)
    assert s["output_throughput"] == pytest.approx(44 / 7.4)
    assert s["total_token_throughput"] == pytest.approx(444 / 7.4)
    # TTFT 100, 200, 300, 400 ms (linear-interpolated percentiles as np.percentile / vLLM)
    assert s["mean_ttft_ms"] == pytest.approx(250)
    assert s["median_ttft_ms"] == pytest.approx(250)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(12500))
    assert s["p90_ttft_ms"] == pytest.approx(370)
    assert s["p99_ttft_ms"] == pytest.approx(397)
    # TPOT 50, 100, 200 ms (the one-token request has none)
    assert s["mean_tpot_ms"] == pytest.approx(350 / 3)
    assert s["median_tpot_ms"] == pytest.approx(100)
    assert s["p90_tpot_ms"] == pytest.approx(180)
    assert s["p99_tpot_ms"] == pytest.approx(198)
    # E2E 300, 700, 1100, 4400 ms
    assert s["mean_e2el_ms"] == pytest.approx(1625)
    assert s["median_e2el_ms"] == pytest.approx(900)
    assert s["p90_e2el_ms"] == pytest.approx(3410)
    assert s["p99_e2el_ms"] == pytest.approx(4301)
    assert s["mean_queueing_delay_ms"] == pytest.approx(50)
    assert s["num_preemptions"] == 3 and s["preempted_requests"] == 2
    assert math.isnan(s["mean_itl_ms"])  # nothing recorded
    assert s["num_iterations"] == 0 and math.isnan(s["max_kv_usage"])


def test_rejected_requests_do_not_change_latency_stats():
    with_rej = _recorder_with_four_requests(with_rejected=True)
    without = _recorder_with_four_requests(with_rejected=False)
    a = summarize(with_rej.requests_frame(), with_rej.iterations_frame())
    b = summarize(without.requests_frame(), without.iterations_frame())
    for k in a:
        if k not in ("rejected", "slo_attainment"):
            assert a[k] == pytest.approx(b[k], nan_ok=True), k
    assert (a["rejected"], b["rejected"]) == (1, 0)


def test_goodput_counts_requests_meeting_every_slo():
    df = _recorder_with_four_requests().requests_frame()
    it = pd.DataFrame(columns=ITERATION_COLUMNS)
    s = summarize(df, it, slo={"ttft_ms": 250, "tpot_ms": 150})  # requests 0 and 1 pass
    assert s["request_goodput"] == pytest.approx(2 / 7.4)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # the rejected request counts as failing
    # A one-token request has no TPOT and passes the TPOT target (vLLM --goodput semantics).
    assert meets_slo(df, {"tpot_ms": 60}).tolist() == [False, True, True, False, False]
    assert meets_slo(df, {"e2el_ms": 1000}).tolist() == [False, True, True, False, False]
    # A target equal to the value passes (value <= target).
    assert meets_slo(df, {"ttft_ms": 200.0 + 1e-9}).tolist() == [True, True, False, False, False]
    no_slo = summarize(df, it)
    assert no_slo["request_goodput"] == pytest.approx(no_slo["request_throughput"])
    with pytest.raises(ValueError, match="ttft_p99"):
        summarize(df, it, slo={"ttft_p99": 1})


def test_summary_values_are_plain_python_and_json_has_no_nan(tmp_path):
    rec = _recorder_with_four_requests()
    s = summarize(rec.requests_frame(), rec.iterations_frame(), rec.itl_histogram)
    assert all(type(v) in (int, float) for v in s.values())
    text = to_json(s)
    assert "NaN" not in text and json.loads(text)["mean_itl_ms"] is None
    extra = {"seed": np.int64(7), "scheduler": "chunked"}
    for d in ("a", "b"):
        write_run(tmp_path / d, rec.requests_frame(), rec.iterations_frame(), s, rec.itl_histogram, extra)
    a, b = ((tmp_path / d / "summary.json").read_bytes() for d in ("a", "b"))
    assert a == b
    assert list(json.loads(a))[:3] == ["seed", "scheduler", "completed"]
    req, it, back, hist = load_run(tmp_path / "a")
    assert len(req) == 5 and math.isnan(back["mean_itl_ms"]) and hist.count == 0
    with pytest.raises(ValueError, match="clash"):
        write_run(tmp_path / "c", req, it, s, None, {"completed": 1})


def test_histogram_quantiles_stay_within_stated_error():
    rng = np.random.default_rng(1)
    x = rng.lognormal(mean=-4.0, sigma=1.0, size=200_000)
    h = LogHistogram()
    for chunk in np.array_split(x, 7):
        h.add(chunk)
    qs = np.array([0.0, 0.001, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0])
    est = h.quantile(qs)
    true = np.percentile(x, qs * 100)
    rel = np.abs(est / true - 1)
    assert rel.max() <= h.max_relative_error * (1 + 1e-9), rel
    assert h.max_relative_error == pytest.approx(0.0005, rel=1e-3)
    assert est[0] == x.min() and est[-1] == x.max()
    assert h.count == x.size
    assert h.mean == pytest.approx(x.mean(), rel=1e-12)
    assert h.std == pytest.approx(x.std(), rel=1e-9)
    assert isinstance(h.quantile(0.5), float)


def _bins_one_by_one(h: LogHistogram, v: np.ndarray) -> np.ndarray:
    """The histogram's counts of ``v`` with every value binned on its own (``add``'s arithmetic)."""
    f = np.log(np.maximum(v, h.lo) * (1.0 / h.lo)) * h._inv_log_ratio
    return np.bincount(np.minimum(f.astype(np.int64), h.num_bins - 1), minlength=h.num_bins)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 3000, 5000, 70_000])
def test_histogram_bins_runs_of_equal_values_as_each_value_alone(n):
    # add() bins a run of equal neighbours (a step's decode rows share one ITL) once: the counts,
    # sum, spread and extremes must be those of binning every value, also at bin edges and clamps
    rng = np.random.default_rng(n)
    h = LogHistogram()
    edges = h.lo * h.ratio ** rng.integers(0, h.num_bins, 50)  # values exactly on bin edges
    pool = np.concatenate([rng.lognormal(-4, 1, 50), edges, np.nextafter(edges, 0), [1e-9, 0.0, 5e3, h.hi]])
    for runs in (True, False):
        if runs:  # a few long runs of one value and some singletons
            v = np.repeat(rng.choice(pool, n), rng.integers(1, 300, n))[:n]
        else:
            v = rng.choice(pool, n)
        a, b = LogHistogram(), LogHistogram()
        a.add(v)
        assert np.array_equal(a.counts, _bins_one_by_one(a, v))
        for part in np.array_split(v, 3):
            b.add(part)
        assert np.array_equal(b.counts, a.counts)
        assert (a.count, a.sum, a.min, a.max) == (v.size, float(np.add.reduce(v)), v.min(), v.max())
        assert a.std == pytest.approx(v.std(), rel=1e-9, abs=1e-15)


def test_histogram_merges_and_round_trips_through_dict():
    rng = np.random.default_rng(2)
    a, b = rng.lognormal(-3, 0.5, 5000), rng.lognormal(-5, 0.5, 3000)
    ha, hb, hall = LogHistogram(), LogHistogram(), LogHistogram()
    ha.add(a)
    hb.add(b)
    hall.add(np.concatenate([a, b]))
    ha.merge(hb)
    assert np.array_equal(ha.counts, hall.counts)
    assert ha.std == pytest.approx(hall.std, rel=1e-9)
    d = json.loads(json.dumps(ha.to_dict()))
    assert len(d["bins"]) == np.count_nonzero(ha.counts)
    back = LogHistogram.from_dict(d)
    qs = np.linspace(0, 1, 21)
    assert np.array_equal(back.quantile(qs), ha.quantile(qs))
    assert (back.mean, back.std, back.count) == (ha.mean, ha.std, ha.count)
    with pytest.raises(ValueError):
        ha.merge(LogHistogram(ratio=1.01))


def test_on_itl_keeps_every_value_across_buffer_flushes():
    rec = MetricsRecorder()
    rng = np.random.default_rng(3)
    chunks = [rng.uniform(0.01, 0.05, n) for n in (0, 5, 40_000, 40_000, 200_000, 7)]
    for c in chunks:
        rec.on_itl(c)
    allv = np.concatenate(chunks)
    h = rec.itl_histogram
    assert h.count == allv.size
    assert h.mean == pytest.approx(allv.mean(), rel=1e-12)
    s = summarize(rec.requests_frame(), rec.iterations_frame(), h)
    assert s["median_itl_ms"] == pytest.approx(np.median(allv) * 1e3, rel=h.max_relative_error)


def test_recorder_keeps_200k_iterations_in_columns():
    rec = MetricsRecorder(num_replicas=2)
    # rows: a 300-token prefill chunk, two decodes, a 1-token prefill of a fresh request (ctx 0)
    b = _batch([300, 1, 1, 1], [0, 50, 60, 0], [False, True, True, True])
    b.swap_out.append((1, 2))
    n = 200_000
    t = time.perf_counter()
    for i in range(n):
        rec.on_iteration(
            replica=i % 2, start=i * 0.01, duration=0.01, batch=b, kv_blocks_used=i % 100,
            kv_blocks_total=200, num_waiting=3, num_running=4, num_swapped=0,
            num_preempted=1 if i == 7 else 0, sched_overhead_s=float("nan"),
        )  # fmt: skip
    per_call_us = (time.perf_counter() - t) / n * 1e6
    df = rec.iterations_frame()
    assert df.shape == (n, len(ITERATION_COLUMNS)) and tuple(df.columns) == ITERATION_COLUMNS
    assert df["num_prefill_tokens"].iloc[0] == 301 and df["num_decode_tokens"].iloc[0] == 2
    assert df["num_tokens"].iloc[-1] == 303 and df["batch_size"].iloc[-1] == 4
    assert df["num_swap_blocks"].iloc[0] == 1 and df["replica"].iloc[-1] == 1
    assert df["start"].iloc[-1] == pytest.approx((n - 1) * 0.01)
    assert df["num_preempted"].sum() == 1 and df["sched_overhead_s"].isna().all()
    s = summarize(rec.requests_frame(), df)
    assert s["max_kv_usage"] == pytest.approx(99 / 200) and s["mean_batch_size"] == 4.0
    assert s["num_iterations"] == n
    assert per_call_us < 50, f"on_iteration took {per_call_us:.1f} us per call"


def test_summary_table_lists_each_latency_and_survives_nan():
    rec = _recorder_with_four_requests()
    table = format_summary_table(
        summarize(rec.requests_frame(), rec.iterations_frame(), slo={"ttft_ms": 250})
    )
    for label in ("TTFT", "TPOT", "ITL", "E2E", "throughput", "goodput"):
        assert label in table
    assert "250.0" in table  # mean TTFT in ms
    empty = MetricsRecorder()
    assert "0 completed" in format_summary_table(summarize(empty.requests_frame(), empty.iterations_frame()))


def _fake_iterations(num_replicas, n=3000, seed=4):
    rng = np.random.default_rng(seed)
    cols = {c: rng.integers(0, 50, n) for c in ITERATION_COLUMNS}
    cols.update(replica=rng.integers(0, num_replicas, n), start=np.sort(rng.uniform(0, 100, n)),
                duration=np.full(n, 0.02), kv_blocks_total=np.full(n, 100),
                sched_overhead_s=np.full(n, np.nan))  # fmt: skip
    return pd.DataFrame(cols)


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 2000


def test_plots_are_written_as_png(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "DPI", 40)  # resolution is not under test; rendering time is
    rec = _recorder_with_four_requests()
    rec.on_itl(np.random.default_rng(5).lognormal(-4, 0.5, 1000))
    req = rec.requests_frame()
    for reps in (1, MAX_REPLICA_LINES + 3):
        paths = plot_run(tmp_path / f"r{reps}", req, _fake_iterations(reps), rec.itl_histogram)
        assert [p.name for p in paths] == ["latency_cdf.png", "timeline.png"]
        assert all(_is_png(p) for p in paths)
    empty = MetricsRecorder()
    assert all(_is_png(p) for p in plot_run(tmp_path / "e", empty.requests_frame(), empty.iterations_frame()))
    ov = plot_cdf_overlay(tmp_path / "ov.png", {"live": req, "sim": req.assign(ttft=req["ttft"] * 1.2)})
    assert _is_png(ov)
    rows = pd.DataFrame({"request_rate": [1.0, 2.0, 4.0], "median_ttft_ms": [50, 70, 400],
                         "p99_ttft_ms": [90, 200, 2000], "median_tpot_ms": [20, 25, 40],
                         "p99_tpot_ms": [30, 40, 90], "median_e2el_ms": [900, 1000, 3000],
                         "p99_e2el_ms": [1500, 2000, 9000], "request_goodput": [1.0, 1.9, 2.5]})  # fmt: skip
    assert _is_png(plot_latency_vs_rate(tmp_path / "lvr.png", rows, chosen_rate=2.0, slo={"ttft_ms": 500}))


def test_a_large_cdf_is_drawn_through_exact_order_statistics_not_every_point():
    """A million requests' CDF: at most ECDF_POINTS points (matplotlib's paths of every point took
    ~400 MB), each an exact point of the CDF, the smallest and largest values among them."""
    from matplotlib.figure import Figure
    from servesim.sim.plots import ECDF_POINTS, _ecdf

    rng = np.random.default_rng(0)
    values = rng.lognormal(-3, 1, 100_000)
    ax = Figure().subplots()
    assert _ecdf(ax, values)
    x, y = ax.lines[0].get_data()
    x, y = np.asarray(x), np.asarray(y)
    v = np.sort(values) * 1e3
    assert len(x) <= ECDF_POINTS and x[0] == v[0] and x[-1] == v[-1] and y[-1] == 1.0
    ranks = np.rint(y * len(v)).astype(int) - 1
    assert np.array_equal(x, v[ranks])
    small = Figure().subplots()
    assert _ecdf(small, values[:100])
    assert len(small.lines[0].get_data()[0]) == 100  # below the cap: every point
