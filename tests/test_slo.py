"""SLO terms: parsing, and what a percentile, a mean and a per-request term mean on pooled requests."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from servesim.sim.metrics import LogHistogram
from servesim.sim.verbs.slo import SloError, evaluate, parse_slo, request_thresholds


def frame(ttft_ms, tpot_ms=None, states=None, out_tokens=None) -> pd.DataFrame:
    n = len(ttft_ms)
    return pd.DataFrame({
        "state": states or ["finished"] * n,
        "ttft": np.asarray(ttft_ms, dtype=float) / 1e3,
        "tpot": np.asarray(tpot_ms if tpot_ms is not None else [10.0] * n, dtype=float) / 1e3,
        "e2e": np.full(n, 1.0),
        "queueing_delay": np.zeros(n),
        "num_output_tokens": out_tokens or [8] * n,
    })  # fmt: skip


def test_terms_parse_with_percentile_mean_median_and_bare_keys():
    terms = parse_slo("p99_ttft_ms=500,p99.9_tpot_ms=50, median_e2el_ms=9000,mean_itl_ms=20,ttft_ms=800")
    assert [(t.stat, t.metric, t.target_ms) for t in terms] == [
        ("p99", "ttft", 500.0), ("p99.9", "tpot", 50.0), ("p50", "e2el", 9000.0), ("mean", "itl", 20.0),
        ("request", "ttft", 800.0),
    ]  # fmt: skip
    assert str(terms[2]) == "p50_e2el_ms=9000"


@pytest.mark.parametrize(
    "text, mentions",
    [
        ("p99_ttf_ms=500", "did you mean 'ttft'"),
        ("p99_ttft_ms", "KEY=MILLISECONDS"),
        ("p99_ttft_ms=fast", "not a number"),
        ("p100_ttft_ms=5", "between 0 and 100"),
        ("itl_ms=50", "per token"),
        ("p99_ttft_ms=-1", "positive"),
        ("p99_ttft_ms=1,p99_ttft_ms=2", "twice"),
        ("", "empty SLO"),
    ],
)
def test_bad_terms_are_one_line_errors_naming_the_problem(text: str, mentions: str):
    with pytest.raises(SloError) as e:
        parse_slo(text)
    assert mentions in str(e.value) and "\n" not in str(e.value)


def test_percentile_term_counts_requests_at_or_under_the_target():
    # 100 requests, TTFT 1..100 ms: exactly 99 are <= 99 ms
    df = frame(np.arange(1, 101))
    (at_99,) = evaluate(parse_slo("p99_ttft_ms=99"), df, None, attainment=0.9)
    (at_98,) = evaluate(parse_slo("p99_ttft_ms=98"), df, None, attainment=0.9)
    assert at_99.value == pytest.approx(0.99) and at_99.passed
    assert at_98.value == pytest.approx(0.98) and not at_98.passed


def test_rejected_requests_miss_every_percentile_and_per_request_term():
    df = frame([1.0] * 99 + [math.nan], states=["finished"] * 99 + ["rejected"])
    (p,) = evaluate(parse_slo("p99.5_ttft_ms=1000"), df, None, attainment=0.9)
    assert p.value == pytest.approx(0.99) and not p.passed
    (r,) = evaluate(parse_slo("ttft_ms=1000"), df, None, attainment=0.995)
    assert not r.passed


def test_per_request_terms_must_hold_together_for_the_attainment():
    # half the requests miss TTFT, the other half miss TPOT: each alone is met by 50 %, together by 0 %
    df = frame([900] * 5 + [100] * 5, tpot_ms=[10] * 5 + [90] * 5)
    (joint,) = evaluate(parse_slo("ttft_ms=500,tpot_ms=50"), df, None, attainment=0.5)
    assert joint.value == 0.0 and not joint.passed
    (alone,) = evaluate(parse_slo("ttft_ms=500"), df, None, attainment=0.5)
    assert alone.value == 0.5 and alone.passed


def test_a_single_token_request_has_no_tpot_and_passes_a_tpot_target():
    df = frame([10, 10], tpot_ms=[math.nan, 500], out_tokens=[1, 8])
    (r,) = evaluate(parse_slo("p50_tpot_ms=50"), df, None, attainment=0.9)
    assert r.value == 0.5 and r.passed


def test_itl_terms_read_the_token_histogram():
    hist = LogHistogram()
    hist.add(np.r_[np.full(990, 0.010), np.full(10, 0.500)])  # 1 % of tokens stall for 500 ms
    ok, tight = evaluate(parse_slo("p99_itl_ms=20,p99.5_itl_ms=20"), frame([1]), hist, attainment=0.9)
    assert ok.value == pytest.approx(0.99) and ok.passed
    assert not tight.passed
    (mean,) = evaluate(parse_slo("mean_itl_ms=20"), frame([1]), hist, attainment=0.9)
    assert mean.value == pytest.approx(14.9) and mean.passed


def test_goodput_thresholds_come_from_per_request_terms_else_the_tightest_percentile():
    assert request_thresholds(parse_slo("p99_ttft_ms=500,p50_ttft_ms=200,p99_itl_ms=50")) == {"ttft_ms": 200.0}
    assert request_thresholds(parse_slo("p99_ttft_ms=500,tpot_ms=40")) == {"tpot_ms": 40.0}
