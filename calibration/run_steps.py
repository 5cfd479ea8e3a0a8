"""Step times of a measured vLLM run read off its engine timestamps, against a cost model's price.

A run in LLMServingSim's format records, per request, ``queued_ts``, ``scheduled_ts``,
``first_token_ts`` and ``last_token_ts`` on the engine's clock. The engine loop takes new requests
in right after a step ends; with vLLM's async scheduling the next step is already scheduled then,
so a request taken in runs in the step after that one (``ahead`` = 1), without it in the next step
(``ahead`` = 0). Two kinds of request time a step exactly, with no queueing in the figure:

- **ramp** (``ramp_steps``): a request that arrived while only decode steps ran since the last step
  end ``a`` (another request's first token; nothing else taken in between) and whose prompt fits
  one chunk was taken in ``queued - a = j d + e`` after it (j whole decode steps of d; e, the loop
  reaching its input, is read into d: d + e / j, ~1 % at the runs' 0.1 ms), and made its first
  token at ``F - a = (j + ahead) d + m``, m its mixed step (its chunk beside the decode rows). j is
  ``round((queued - a) / d_priced)``; taken in at once after ``a`` (j = 0) with a step ahead, only
  d + m is known. Because j comes from the price, a decode price off by more than 1 / (2j) moves j
  instead of the ratio (a price 15 % low reads a gap of 8 steps as 9, and 8/9 / 0.85 = 1.05): the
  decode figure is also given for j <= 2 alone, which a price 20 % low or 33 % high cannot move.
- **seat** (``seat_steps``): a request that waited for a seat was scheduled right after the step
  that freed it ended and ran ``ahead`` decode steps later: ``m = F - scheduled - ahead d_priced``,
  kept where no other admission came within 2.5 decode steps.

Each is set against the cost model's price of the same rows: decode rows' contexts are their
prompts plus the tokens they had made by then at their own TPOT. Without async scheduling the
measured steps include the loop's host time between steps, which the price holds only as the cost
model's host term. A run without these timestamps (vLLM's own bench JSON) is not read this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

MAX_CASES = 500  # steps read per kind: evenly over the run beyond that (each costs a pass over the requests)


def engine_times(requests: pd.DataFrame) -> pd.DataFrame | None:
    """The engine timestamps of a measured run's requests frame (``measured_run``: ``first_scheduled_time``,
    ``first_token_time``, ``finish_time`` and ``ttft_from_queued``), seconds on the engine's clock, or
    None where the run format has no engine timestamps."""
    need = ("first_scheduled_time", "first_token_time", "finish_time", "ttft_from_queued")
    if any(c not in requests for c in need) or not np.isfinite(requests[list(need)].to_numpy(float)).all():
        return None
    first = requests["first_token_time"].to_numpy(float)
    return pd.DataFrame({
        "input_toks": requests["prompt_len"].to_numpy(np.int64),
        "output_toks": requests["output_len"].to_numpy(np.int64),
        "queued_ts": first - requests["ttft_from_queued"].to_numpy(float),
        "scheduled_ts": requests["first_scheduled_time"].to_numpy(float),
        "first_token_ts": first, "last_token_ts": requests["finish_time"].to_numpy(float),
    })


def _contexts(req: pd.DataFrame, at: float) -> np.ndarray:
    """Cached tokens of the requests decoding at ``at``: prompt + tokens made by then at their own TPOT."""
    live = req[(req["first_token_ts"] <= at + 1e-9) & (req["last_token_ts"] > at)]
    made = (live["output_toks"] - 1).clip(lower=0).to_numpy(dtype=float)
    span = (live["last_token_ts"] - live["first_token_ts"]).to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):  # (a zero span: every token made at once)
        done = np.where(span > 0, (at - live["first_token_ts"].to_numpy(dtype=float)) / span, 1.0)
    return live["input_toks"].to_numpy(dtype=np.int64) + np.floor(np.clip(done, 0.0, 1.0) * made).astype(np.int64)


def _price(cost: Any, chunks: list[int], decode_ctx: np.ndarray) -> float:
    q = np.r_[np.asarray(chunks, dtype=np.int64), np.ones(len(decode_ctx), dtype=np.int64)]
    c = np.r_[np.zeros(len(chunks), dtype=np.int64), decode_ctx]
    return float(cost.iteration_time(q, c)) if len(q) else 0.0


def _spread(idx: np.ndarray, most: int = MAX_CASES) -> np.ndarray:
    return idx if len(idx) <= most else idx[np.linspace(0, len(idx) - 1, most).round().astype(int)]


def ramp_steps(req: pd.DataFrame, cost: Any, budget: int, ahead: int = 1) -> pd.DataFrame:
    """Decode and mixed steps of the ramp (module docstring; ``ahead``: steps already scheduled when a
    request is taken in, 1 with async scheduling): one row per request, or group taken in together,
    that arrived while only decode steps ran since the last step end (ms, measured and priced)."""
    queued = np.sort(req["queued_ts"].to_numpy())
    # requests by the step that made their first token (one timestamp a step): one pass, sorted
    steps = req.assign(wait=req["scheduled_ts"] - req["queued_ts"]).groupby("first_token_ts", sort=True).agg(
        taken=("queued_ts", "min"), wait=("wait", "max"), longest=("input_toks", "max"))
    ends, taken = steps.index.to_numpy()[1:], steps["taken"].to_numpy()[1:]
    prev = steps.index.to_numpy()[:-1]  # the step end before each: another request's first token
    between = np.searchsorted(queued, taken, "left") - np.searchsorted(queued, prev, "right")
    # not waited for a seat, one chunk, arrived after the step end with nobody else in between
    ok = (steps["wait"].to_numpy()[1:] <= 1e-3) & (steps["longest"].to_numpy()[1:] <= budget) & (taken >= prev) \
        & (between == 0)
    out = []
    for k in _spread(np.flatnonzero(ok)):
        a, f = prev[k], ends[k]
        group = req[req["first_token_ts"] == f]
        ctx = _contexts(req, a)
        if not len(ctx):
            continue
        d_priced = _price(cost, [], ctx)
        if not d_priced > 0:
            continue  # (a cost model that prices a decode step at nothing times nothing)
        mixed = _price(cost, group["input_toks"].tolist(), ctx + int(round((f - a) / d_priced)))
        j = int(round((group["queued_ts"].min() - a) / d_priced))
        row = {"at_s": a, "rows": len(ctx), "prompt": int(group["input_toks"].sum()), "j": j,
               "decode_priced_ms": 1e3 * d_priced, "mixed_priced_ms": 1e3 * mixed}
        if j >= 1:
            d = (group["queued_ts"].min() - a) / j
            row |= {"decode_ms": 1e3 * d, "mixed_ms": 1e3 * (f - a - (j + ahead) * d), "pair_ms": np.nan}
        elif not ahead:  # taken in as the step ended, run in the next: the mixed step alone
            row |= {"decode_ms": np.nan, "mixed_ms": 1e3 * (f - a), "pair_ms": np.nan}
        else:
            row |= {"decode_ms": np.nan, "mixed_ms": np.nan, "pair_ms": 1e3 * (f - a)}
        out.append(row)
    return pd.DataFrame(out, columns=["at_s", "rows", "prompt", "j", "decode_priced_ms", "mixed_priced_ms",
                                      "decode_ms", "mixed_ms", "pair_ms"])


def seat_steps(req: pd.DataFrame, cost: Any, budget: int, seats: int, ahead: int = 1) -> pd.DataFrame:
    """Mixed steps of requests admitted to a freed seat (module docstring; ms, measured and priced)."""
    waited = np.flatnonzero(((req["scheduled_ts"] - req["queued_ts"]) > 0.05).to_numpy()
                            & (req["input_toks"] <= budget - seats).to_numpy())
    sched = np.sort(req["scheduled_ts"].to_numpy())
    out = []
    for i in _spread(waited):
        r = req.iloc[i]
        ctx = _contexts(req, r["scheduled_ts"])
        if len(ctx) < seats - 2:
            continue
        d_priced = _price(cost, [], ctx)
        if not d_priced > 0:
            continue
        lo, hi = np.searchsorted(sched, [r["scheduled_ts"] - 2.5 * d_priced, r["scheduled_ts"] + 2.5 * d_priced])
        if hi - lo > 1:
            continue  # another admission close by: the step before it may not be a decode step
        out.append({"at_s": r["scheduled_ts"], "rows": len(ctx), "prompt": int(r["input_toks"]),
                    "longest": int(ctx.max()), "decode_priced_ms": 1e3 * d_priced,
                    "mixed_priced_ms": 1e3 * _price(cost, [int(r["input_toks"])], ctx + 1),
                    "mixed_ms": 1e3 * (r["first_token_ts"] - r["scheduled_ts"] - ahead * d_priced)})
    return pd.DataFrame(out, columns=["at_s", "rows", "prompt", "longest", "decode_priced_ms", "mixed_priced_ms",
                                      "mixed_ms"])


def quartiles_text(q: dict[str, float | int]) -> str:
    """A ``StepTiming.summary`` figure as text: median (quartiles q25-q75, n steps)."""
    return f"{q['median']:.3f} (quartiles {q['q25']:.3f}-{q['q75']:.3f}, {q['n']} steps)"


def _quartiles(x: pd.Series) -> dict[str, float | int]:
    x = x.dropna()
    if not len(x):
        return {"n": 0}
    q = x.quantile([0.25, 0.5, 0.75]).to_numpy()
    return {"n": int(len(x)), "median": round(float(q[1]), 4), "q25": round(float(q[0]), 4),
            "q75": round(float(q[2]), 4)}


@dataclass
class StepTiming:
    """``ramp_steps`` and ``seat_steps`` of one run, and their summary (ratios measured / priced)."""

    ramp: pd.DataFrame
    seat: pd.DataFrame
    long_row: int = 4096  # seat steps split at a decode row longer than this (a power-of-two skew bucket edge)

    def summary(self) -> dict[str, Any]:
        r, s = self.ramp, self.seat
        out: dict[str, Any] = {
            "ramp_decode": _quartiles(r["decode_ms"] / r["decode_priced_ms"]),
            "ramp_decode_j_at_most_2": _quartiles((r["decode_ms"] / r["decode_priced_ms"])[r["j"] <= 2]),
            "ramp_mixed": _quartiles(r["mixed_ms"] / r["mixed_priced_ms"]),
            "ramp_decode_plus_mixed": _quartiles(r["pair_ms"] / (r["decode_priced_ms"] + r["mixed_priced_ms"])),
            "seat_mixed": _quartiles(s["mixed_ms"] / s["mixed_priced_ms"]),
        }
        if len(s):
            long = s["longest"] > self.long_row
            out[f"seat_mixed_rows_at_most_{self.long_row}"] = _quartiles((s["mixed_ms"] / s["mixed_priced_ms"])[~long])
            out[f"seat_mixed_a_row_over_{self.long_row}"] = _quartiles((s["mixed_ms"] / s["mixed_priced_ms"])[long])
        timed = r.dropna(subset=["mixed_ms"])
        if len(timed):
            extra = (timed["mixed_ms"] - timed["mixed_priced_ms"]).to_numpy()
            out["ramp_mixed_extra_ms"] = {"mean": round(float(extra.mean()), 3), "sd": round(float(extra.std()), 3)}
        return out

    def frame(self) -> pd.DataFrame:
        """Both tables in one (``kind``: ramp or seat), for ``step_timing.csv``."""
        return pd.concat([self.ramp.assign(kind="ramp"), self.seat.assign(kind="seat")], ignore_index=True)

    def markdown(self) -> list[str]:
        """One line per figure of ``summary``."""
        label = {"ramp_decode": "ramp, decode steps",
                 "ramp_decode_j_at_most_2": "  of which taken in 1-2 decode steps after a step end (j <= 2: a "
                                            "price 20 % low or 33 % high cannot move j)",
                 "ramp_mixed": "ramp, mixed steps",
                 "ramp_decode_plus_mixed": "ramp, a decode step and the mixed step after it (taken in at a step end)",
                 "seat_mixed": "seats freed in saturation, mixed steps",
                 f"seat_mixed_rows_at_most_{self.long_row}": f"  of which every decode row <= {self.long_row} tokens",
                 f"seat_mixed_a_row_over_{self.long_row}": f"  of which a decode row > {self.long_row} tokens"}
        lines = []
        for key, q in self.summary().items():
            if key == "ramp_mixed_extra_ms":
                lines.append(f"- ramp mixed steps beyond their price: {q['mean']:.2f} ms on average (sd {q['sd']:.2f})")
            elif q["n"]:
                lines.append(f"- {label[key]}: {quartiles_text(q)}")
        return lines


def step_timing(req: pd.DataFrame, cost: Any, budget: int, seats: int, async_scheduling: bool = True) -> StepTiming:
    """Both readings of a run's engine timestamps (``engine_times``) against ``cost``."""
    ahead = int(async_scheduling)
    return StepTiming(ramp_steps(req, cost, budget, ahead), seat_steps(req, cost, budget, seats, ahead))
