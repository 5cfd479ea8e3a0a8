"""Reader of ``vllm bench serve --save-result --save-detailed`` JSON (the client's view of a run;
``calibration/measured_run.py``'s docstring says what it holds and lacks)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from servesim.sim.config_model import MAX_SIM_SECONDS
from servesim.sim.metrics import LogHistogram

from .run_files import (
    MeasuredRun,
    RunFileError,
    itl_gaps,
    model_preset,
    number_field,
    read_json,
    requests_frame,
    token_count,
)


# ---- vllm bench serve JSON ------------------------------------------------------------------------
def read_vllm_bench(path: str | Path, seed: int = 0) -> MeasuredRun:
    """Read ``vllm bench serve --save-result --save-detailed`` output (see the module docstring).

    Without ``start_times`` (vLLM releases before they were saved) the arrivals are unknown: at an
    infinite ``request_rate`` every request is sent at once (exact); otherwise they are drawn from
    the benchmark's own process (gamma gaps of shape ``burstiness`` at ``request_rate``, seeded),
    which matches the traffic but not each request, and ``arrivals_exact`` is False.
    """
    p = Path(path)
    data = read_json(p)
    if not isinstance(data, dict):
        raise RunFileError(f"{p}: expected the JSON object vllm bench serve writes")
    for name in ("input_lens", "output_lens", "ttfts"):
        if data.get(name) is None:
            raise RunFileError(f"{p}: missing field '{name}' (run vllm bench serve with --save-result --save-detailed)")
        if not isinstance(data[name], list):
            raise RunFileError(f"{p}: field '{name}' must be a list with one entry per request, got {data[name]!r:.60}")
    n = len(data["input_lens"])
    if n == 0:  # (an empty 'latencies' list read as a missing field)
        raise RunFileError(f"{p}: the run has no requests (input_lens is empty)")
    latencies = data["latencies"] if data.get("latencies") is not None else data.get("e2els")
    if latencies is None and not isinstance(data.get("itls"), list):
        raise RunFileError(f"{p}: missing field 'latencies' (or 'itls' to add up): the requests' end-to-end times")
    per_request = {k: data.get(k) for k in ("output_lens", "ttfts", "itls", "start_times", "errors")}
    per_request["latencies"] = latencies
    for k, v in per_request.items():
        if v is not None and not isinstance(v, list):
            raise RunFileError(f"{p}: field '{k}' must be a list with one entry per request, got {v!r:.60}")
        if v is not None and len(v) != n:
            raise RunFileError(f"{p}: field '{k}' has {len(v)} entries, input_lens has {n}")
    errors = per_request["errors"] or [""] * n
    ok = [i for i in range(n) if not errors[i]]
    notes = []
    if len(ok) < n:
        notes.append(f"{n - len(ok)} failed requests (non-empty 'errors') left out")
    if not ok:
        raise RunFileError(f"{p}: no successful requests")

    def col(name: str, i: int) -> float:
        return number_field(per_request[name][i], f"{p}: request {i}", name)

    def seconds(name: str, i: int, least: float = 0.0) -> float:
        """A duration of request i: at least ``least`` (its TTFT for its latency), at most MAX_SIM_SECONDS."""
        v = col(name, i)
        if not least <= v <= MAX_SIM_SECONDS:
            bound = "its TTFT" if least else "0"
            raise RunFileError(f"{p}: request {i}: field '{name}' must be seconds between {bound} and "
                               f"{MAX_SIM_SECONDS:.0e}, got {v!r}")
        return v

    prompt = np.array([token_count(data["input_lens"][i], f"{p}: request {i}", "input_lens", 1) for i in ok])
    output = np.array([token_count(per_request["output_lens"][i], f"{p}: request {i}", "output_lens", 0) for i in ok])
    ttft = np.array([seconds("ttfts", i) for i in ok])
    itls = per_request["itls"]
    gaps_of = {i: itl_gaps(itls[i], f"{p}: request {i}") for i in ok} if isinstance(itls, list) else {}
    for j, i in enumerate(ok):  # a gap per streamed chunk after the first: at most one per token after it
        if len(gaps_of.get(i, ())) > max(int(output[j]) - 1, 0):
            raise RunFileError(f"{p}: request {i}: {len(gaps_of[i])} itls for output_lens {int(output[j])} (at most "
                               f"{max(int(output[j]) - 1, 0)}: a gap between consecutive tokens)")
    if latencies is not None:
        e2e = np.array([seconds("latencies", i, least=t) for i, t in zip(ok, ttft, strict=True)])
    else:
        e2e = ttft + np.array([float(sum(gaps_of[i])) for i in ok])
    hist = None
    gaps = [x for i in ok for x in gaps_of.get(i, [])]
    if gaps:
        hist = LogHistogram()
        hist.add(np.asarray(gaps, dtype=np.float64))
    rate = data.get("request_rate", "inf")
    if rate in ("inf", "Infinity", None) or (isinstance(rate, float) and math.isinf(rate) and rate > 0):
        rate = math.inf
    elif isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
        raise RunFileError(f"{p}: field 'request_rate' must be a number > 0 or \"inf\", got {rate!r}")
    exact = True
    if per_request["start_times"] is not None:
        start = np.array([col("start_times", i) for i in ok])
    elif math.isinf(rate):
        start = np.zeros(len(ok))
        notes.append("no start_times: request_rate inf, every request sent at t = 0")
    else:
        burst = 1.0 if data.get("burstiness") is None else number_field(data["burstiness"], str(p), "burstiness")
        if not burst > 0:
            raise RunFileError(f"{p}: field 'burstiness' must be > 0, got {burst!r}")
        rng = np.random.default_rng(seed)
        start = np.concatenate([[0.0], np.cumsum(rng.gamma(burst, 1.0 / (rate * burst), len(ok) - 1))])
        exact = False
        notes.append(f"no start_times (vLLM before they were saved): arrivals drawn from gamma gaps, "
                     f"rate {rate:g}/s, burstiness {burst:g}, seed {seed}: the traffic, not each request")
    if start.max() - start.min() > MAX_SIM_SECONDS:  # servesim's clock resolves steps up to there
        first, last = ok[int(np.argmin(start))], ok[int(np.argmax(start))]
        what = (f"field 'start_times' spans {start.max() - start.min():.3g} s (request {first} to request {last})"
                if exact else f"field 'request_rate' {rate:g} spreads the arrivals over {start.max():.3g} s")
        raise RunFileError(f"{p}: {what}, past the {MAX_SIM_SECONDS:.0e} s servesim simulates; "
                           f"{'they must be seconds of one clock' if exact else 'the rate must be requests per second'}")
    conc = data.get("max_concurrency")
    if conc is not None and (isinstance(conc, bool) or not isinstance(conc, int) or conc < 1):
        raise RunFileError(f"{p}: field 'max_concurrency' must be a whole number >= 1 or null, got {conc!r:.60}")
    if conc:
        notes.append(f"max_concurrency {data['max_concurrency']}: the client's own queue is replayed as the "
                     "measured send times, not as a closed loop")
    order = np.argsort(start, kind="stable")
    start, prompt, output, ttft, e2e = (a[order] for a in (start - start.min(), prompt, output, ttft, e2e))
    df = requests_frame(start, np.full(len(ok), np.nan), start + ttft, start + e2e, prompt, output)
    df["source_id"] = [str(ok[i]) for i in order]
    df["source_line"] = 0  # one JSON document: requests are list positions
    model_source = str(data.get("model_id") or data.get("tokenizer_id") or "")
    if not model_source:
        raise RunFileError(f"{p}: missing field 'model_id'")
    notes.append("client-side times: TTFT and E2E include the HTTP round trip and detokenisation")
    return MeasuredRun(
        name=p.stem, path=p, format="vllm-bench", model_source=model_source, model=model_preset(model_source),
        hardware_source=data.get("gpu") or data.get("hardware"), hardware=None, tensor_parallel=None,
        scheduler={}, kv_cache={}, requests=df, itl_hist=hist, clock={"alignment": "client clock (start_times)"},
        notes=notes, arrivals_exact=exact,
    )
