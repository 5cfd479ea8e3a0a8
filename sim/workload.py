"""Workloads: arrival processes, length distributions and trace readers -> ``list[Request]``.

A scenario embeds a :class:`WorkloadConfig` under ``workload:``::

    workload:
      num_requests: 2000        # and/or duration_s: 600 (arrivals at t < duration_s); one is required
      arrival: {process: poisson, rate: 8.0}   # poisson | gamma | constant | trace
      prompt_len: {dist: lognormal, mean: 1000, std: 600, min: 16, max: 8192}
      output_len: {dist: uniform, min: 16, max: 512}          # a bare number means fixed
      prefix: {num_prefixes: 4, prefix_len: 512, fraction: 0.5}
      token_ids: false          # true: deterministic prompt_token_ids (live mode needs them)

or takes arrivals *and* lengths from a recorded trace (then ``arrival``, ``prompt_len`` and
``output_len`` must be left out; ``num_requests`` / ``duration_s`` are optional caps)::

    workload:
      trace: {format: azure, path: AzureLLMInferenceTrace_conv.csv, time_scale: 1.0}

Conventions (times in seconds, lengths in tokens):

- poisson / gamma: the first request arrives after the first gap, not at t = 0, so every
  request, the first included, sees the same inter-arrival law. constant: request i at i / rate.
  Traces: timestamps relative to the earliest kept row, times ``time_scale``.
- gamma follows vLLM ``benchmark_serving.py``: gaps ~ Gamma(shape=burstiness,
  scale=1 / (rate * burstiness)), mean gap 1 / rate. The gaps' coefficient of variation is
  cv = 1 / sqrt(burstiness): cv = 1 is Poisson, cv > 1 burstier, cv < 1 smoother. Give ``cv`` or
  ``burstiness``.
- normal / lognormal lengths are rounded and clipped (not redrawn) into [min, max]; lognormal
  ``mean`` / ``std`` are those of the lengths themselves, not of their log.
- zipf: numpy ``zipf(a)`` draws k = 1, 2, ... with P(k) ~ k^-a; the length is ``min + k - 1``,
  draws above ``max`` are redrawn (up to 64 rounds, then clipped to ``max``).
- Every random stream has its own child generator of ``SeedSequence(seed)`` (arrivals, prompt
  lengths, output lengths, prefixes, token ids), so changing one distribution leaves the others'
  draws unchanged.
"""

from __future__ import annotations

import gc
import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .config_model import INT_MAX, MAX_SIM_SECONDS, ConfigModel
from .errors import WorkloadError, not_a_file
from .mooncake import read_mooncake
from .request import Request
from .sessions import build_sessions

log = logging.getLogger(__name__)

# Child stream indices of SeedSequence(seed).spawn(); append new streams, never renumber.
_ARRIVALS, _PROMPT, _OUTPUT, _PREFIX, _TOKENS, _SESSIONS = range(6)
_ZIPF_ROUNDS = 64


# --------------------------------------------------------------------------- config


def _check(what: str, ok: Any, allowed: str) -> AfterValidator:
    def check(v: Any) -> Any:
        if v is not None and not ok(v):
            raise PydanticCustomError("value_error", f"{what} must be {allowed}, got {v!r}")
        return v

    return AfterValidator(check)


def _finite_pos(v: float) -> bool:
    return math.isfinite(v) and v > 0


Rate = Annotated[float, _check("rate", _finite_pos, "> 0 requests/s")]
TimeScale = Annotated[float, _check("time_scale", _finite_pos, "> 0 (0.5 replays twice as fast)")]


def _tokens(name: str) -> Any:
    """An int field of tokens that must be >= 1; errors name the field."""
    return Annotated[int, _check(name, lambda v: v >= 1, ">= 1 token")]


class _Strict(ConfigModel):
    """A workload section (unknown fields are errors whose path names the key: see scenario.py)."""


class PoissonArrival(_Strict):
    """Exponential gaps, mean 1 / rate seconds."""

    process: Literal["poisson"]
    rate: Rate


class GammaArrival(_Strict):
    """Gamma gaps, mean 1 / rate seconds, coefficient of variation cv = 1 / sqrt(burstiness)."""

    process: Literal["gamma"]
    rate: Rate
    cv: Annotated[float | None, _check("cv", _finite_pos, "> 0 (1 = Poisson)")] = None
    burstiness: Annotated[float | None, _check("burstiness", _finite_pos, "> 0 (1 = Poisson)")] = None

    @model_validator(mode="after")
    def _one_of_cv_or_burstiness(self) -> GammaArrival:
        if (self.cv is None) == (self.burstiness is None):
            raise PydanticCustomError(
                "value_error", "gamma arrivals need exactly one of cv or burstiness (cv = 1/sqrt(burstiness))"
            )
        return self

    @property
    def shape(self) -> float:
        """Gamma shape parameter = vLLM's burstiness = 1 / cv^2."""
        return self.burstiness if self.burstiness is not None else 1.0 / self.cv**2


class ConstantArrival(_Strict):
    """One request every 1 / rate seconds, the first at t = 0."""

    process: Literal["constant"]
    rate: Rate


class TraceArrival(_Strict):
    """Arrival timestamps (seconds) from a CSV column; lengths still come from the distributions."""

    process: Literal["trace"]
    path: Path
    column: str
    time_scale: TimeScale = 1.0


Arrival = Annotated[
    PoissonArrival | GammaArrival | ConstantArrival | TraceArrival, Field(discriminator="process")
]


class FixedLength(_Strict):
    dist: Literal["fixed"]
    value: _tokens("value")


class _Bounded(_Strict):
    min: _tokens("min") = 1
    max: _tokens("max") | None = None

    @model_validator(mode="after")
    def _min_le_max(self) -> _Bounded:
        if self.max is not None and self.max < self.min:
            raise PydanticCustomError("value_error", f"max ({self.max}) must be >= min ({self.min})")
        return self


class UniformLength(_Bounded):
    """Integers uniform on [min, max], both included."""

    dist: Literal["uniform"]
    max: _tokens("max")


class NormalLength(_Bounded):
    dist: Literal["normal"]
    mean: Annotated[float, _check("mean", lambda v: 0 < v <= INT_MAX, f"in (0, {INT_MAX}] tokens")]
    std: Annotated[float, _check("std", lambda v: 0 <= v <= INT_MAX, f"in [0, {INT_MAX}] tokens")]


class LognormalLength(NormalLength):
    """mean / std are of the lengths themselves (not of their log)."""

    dist: Literal["lognormal"]  # type: ignore[assignment]


class ZipfLength(_Bounded):
    """length = min + k - 1 with P(k) ~ k^-a, redrawn above max."""

    dist: Literal["zipf"]
    a: Annotated[float, _check("a", lambda v: math.isfinite(v) and v > 1, "> 1 (numpy zipf)")]
    max: _tokens("max")


class EmpiricalLength(_Strict):
    """Lengths drawn with replacement from a CSV column."""

    dist: Literal["empirical"]
    path: Path
    column: str


LengthDist = Annotated[
    FixedLength | UniformLength | NormalLength | LognormalLength | ZipfLength | EmpiricalLength,
    Field(discriminator="dist"),
]


class PrefixConfig(_Strict):
    """Shared prompt prefixes (system prompts): a ``fraction`` of requests get a prefix_id in
    [0, num_prefixes), uniformly, and share its first ``prefix_len`` tokens (clipped to the prompt).
    """

    num_prefixes: Annotated[int, _check("num_prefixes", lambda v: v >= 1, ">= 1")]
    prefix_len: _tokens("prefix_len")
    fraction: Annotated[float, _check("fraction", lambda v: 0 <= v <= 1, "in [0, 1]")] = 1.0


_TRACE_COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "csv": ("arrival_time", "prompt_len", "output_len"),
    "mooncake": ("timestamp", "input_length", "output_length"),  # JSONL, read by mooncake.py
}


class TraceConfig(_Strict):
    """A request trace: arrivals and lengths from one CSV.

    Formats: ``azure`` (Azure LLM inference trace: TIMESTAMP datetimes, ContextTokens,
    GeneratedTokens), ``burstgpt`` (Timestamp seconds, Request tokens, Response tokens; rows with
    0 response tokens are failed requests and are dropped and counted), ``csv`` (any columns;
    defaults arrival_time, prompt_len, output_len; times in seconds or datetimes).
    ``start`` skips that many data rows of the file; ``limit`` caps the requests kept.
    """

    format: Literal["azure", "burstgpt", "csv", "mooncake"]
    path: Path
    time_column: str | None = None
    prompt_column: str | None = None
    output_column: str | None = None
    time_scale: TimeScale = 1.0
    start: Annotated[int, _check("start", lambda v: v >= 0, ">= 0 rows")] = 0
    limit: Annotated[int | None, _check("limit", lambda v: v >= 1, ">= 1 requests")] = None

    def columns(self) -> tuple[str, str, str]:
        """(time, prompt, output) column names, the format's defaults where not given."""
        t, p, o = _TRACE_COLUMNS[self.format]
        return (self.time_column or t, self.prompt_column or p, self.output_column or o)


class SessionConfig(_Strict):
    """Multi-turn conversations (sim/sessions.py): the workload's arrival process starts sessions
    (``num_requests`` / ``duration_s`` count and bound session starts), ``prompt_len`` is each
    turn's new user message and ``output_len`` each reply; every turn resends the conversation."""

    turns: LengthDist
    think_time_s: Annotated[float, _check("think_time_s", lambda v: 0 <= v <= MAX_SIM_SECONDS,
                                          f"between 0 and {MAX_SIM_SECONDS:.0e} seconds")] = 0.0
    think_time_dist: Literal["exponential", "fixed"] = "exponential"
    system_prompt_len: Annotated[int, _check("system_prompt_len", lambda v: v >= 0, ">= 0 tokens")] = 0

    @field_validator("turns", mode="before")
    @classmethod
    def _bare_number_is_fixed(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return {"dist": "fixed", "value": v}
        return v


class WorkloadConfig(_Strict):
    """What traffic to generate. See the module docstring for the YAML shape."""

    num_requests: Annotated[int | None, _check("num_requests", lambda v: v >= 1, ">= 1")] = None
    duration_s: Annotated[float | None, _check("duration_s", _finite_pos, "> 0 seconds")] = None
    arrival: Arrival | None = None
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    prefix: PrefixConfig | None = None
    trace: TraceConfig | None = None
    sessions: SessionConfig | None = None
    token_ids: bool = False
    vocab_size: Annotated[int, _check("vocab_size", lambda v: v >= 2, ">= 2")] = 32000

    @field_validator("prompt_len", "output_len", mode="before")
    @classmethod
    def _bare_number_is_fixed(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return {"dist": "fixed", "value": v}
        return v

    @model_validator(mode="after")
    def _complete(self) -> WorkloadConfig:
        parts = ("arrival", "prompt_len", "output_len")
        if self.sessions is not None and (self.trace is not None or self.token_ids or self.prefix is not None):
            clash = "trace" if self.trace is not None else "token_ids" if self.token_ids else "prefix"
            raise PydanticCustomError("value_error", f"sessions build their own prompts; remove {clash} "
                                      "(use sessions.system_prompt_len for a shared prefix)")
        if self.trace is not None:
            given = [p for p in parts if getattr(self, p) is not None]
            if given:
                raise PydanticCustomError(
                    "value_error",
                    f"trace supplies arrivals and lengths; remove {', '.join(given)} (or remove trace)",
                )
            return self
        missing = [p for p in parts if getattr(self, p) is None]
        if missing:
            raise PydanticCustomError(
                "value_error", f"missing {', '.join(missing)} (required unless a trace is given)"
            )
        bounded_by_file = isinstance(self.arrival, TraceArrival)
        if self.num_requests is None and self.duration_s is None and not bounded_by_file:
            raise PydanticCustomError("value_error", "set num_requests or duration_s (at least one)")
        return self

    def resolve_paths(self, base_dir: str | Path) -> WorkloadConfig:
        """A copy whose relative file paths are taken relative to ``base_dir`` (the scenario's folder)."""
        base = Path(base_dir)

        def fix(part: Any) -> Any:
            path = getattr(part, "path", None)
            if path is None:
                return part
            path = path.expanduser()
            return part.model_copy(update={"path": path if path.is_absolute() else base / path})

        return self.model_copy(
            update={k: fix(getattr(self, k)) for k in ("arrival", "prompt_len", "output_len", "trace")}
        )


# --------------------------------------------------------------------------- files


_CSV_ROWS = 1 << 16  # rows per chunk: a trace is read in slices, so its text never sits in memory whole


def _csv_chunks(path: Path, columns: dict[str, str], where: str) -> Iterator[Any]:
    """The named CSV columns in slices of ``_CSV_ROWS`` rows (DataFrames whose index is the data
    row number, 0-based, across slices); ``columns`` maps config field -> column name.

    A multi-million-row trace parsed whole holds every cell as a Python object at once (~150 MB
    per million Azure rows); slice by slice only the numbers that are kept grow with the file."""
    import pandas as pd  # pandas only when a file is read: keeps `import workload` light

    unreadable = (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError)
    if why := not_a_file(path):
        raise WorkloadError(f"{where}.path: {why}")
    if path.stat().st_size == 0:
        raise WorkloadError(f"{where}.path: {path} is empty")
    try:
        header = list(pd.read_csv(path, nrows=0).columns)
    except unreadable as e:
        raise WorkloadError(f"{where}.path: cannot read {path} as CSV: {str(e).splitlines()[0]}") from e
    for fld, col in columns.items():
        if col not in header:
            raise WorkloadError(
                f"{where}.{fld}: column {col!r} not in {path}; columns are: {', '.join(map(repr, header))}"
            )
    try:  # a file can go bad after its header (binary rows, a cut-off quote)
        with pd.read_csv(path, usecols=list(dict.fromkeys(columns.values())), chunksize=_CSV_ROWS) as reader:
            yield from reader
    except unreadable as e:
        raise WorkloadError(f"{where}.path: cannot read {path} as CSV: {str(e).splitlines()[0]}") from e


def _numeric(series: Any, src: str, most: float | None = None, whole: bool = False) -> np.ndarray:
    """Column values as float64, each at most ``most`` where given (token counts) and a whole
    number >= 0 where ``whole`` (a trace's token counts: a fraction means another column); ``src``
    ("<field>: column 'x' of <path>") prefixes errors, which name the file's line. ``true`` and
    ``false`` are no numbers here (pandas reads them as 1 and 0)."""
    import pandas as pd

    if series.dtype == bool or series.dtype == object:  # (an object column may hold a few booleans)
        flags = series.map(lambda v: isinstance(v, bool | np.bool_)).to_numpy(dtype=bool)
        if flags.any():
            first = int(np.flatnonzero(flags)[0])
            raise WorkloadError(f"{src}, line {int(series.index[first]) + 2}: {series.iloc[first]} is not a number")
    values = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        line = int(series.index[np.flatnonzero(bad)[0]]) + 2  # + header, 1-based
        raise WorkloadError(f"{src} has {int(bad.sum())} empty or non-numeric values (first at line {line})")
    if most is not None and (values > most).any():
        first = np.flatnonzero(values > most)[0]
        line = int(series.index[first]) + 2
        raise WorkloadError(f"{src}, line {line}: {values[first]:.6g} tokens is more than any context "
                            f"(at most {most:.0f}); is it the right column?")
    if whole and (values < 0).any():  # (BurstGPT's failed rows have 0; below that is no count at all)
        first = np.flatnonzero(values < 0)[0]
        raise WorkloadError(f"{src}, line {int(series.index[first]) + 2}: {values[first]:.6g} tokens is negative; "
                            "is it the right column?")
    if whole and (values != np.rint(values)).any():
        first = np.flatnonzero(values != np.rint(values))[0]
        raise WorkloadError(f"{src}, line {int(series.index[first]) + 2}: {values[first]:.6g} is not a whole number "
                            "of tokens; is it the right column?")
    return values


class _Seconds:
    """A time column read slice by slice: numbers are seconds as they stand; text is datetimes,
    returned as seconds since the earliest. The first slice decides which (``datetimes`` forces
    datetimes): a column with any number in it is numbers, so one bad cell is reported by line."""

    def __init__(self, src: str, datetimes: bool) -> None:
        self.src, self.parts, self.forced = src, [], datetimes
        self.datetimes: bool | None = True if datetimes else None  # None: the first slice decides

    def add(self, series: Any) -> None:
        import pandas as pd

        if self.datetimes is None:
            self.datetimes = not pd.api.types.is_numeric_dtype(series) and \
                not pd.to_numeric(series, errors="coerce").notna().any()
        elif self.datetimes and pd.api.types.is_numeric_dtype(series) and series.notna().any():
            # pandas would read the numbers as nanoseconds since 1970: a silent factor of 1e9
            where = "this format has datetimes" if self.forced else "its first rows are datetimes"
            line = int(series.index[0]) + 2
            raise WorkloadError(f"{self.src} holds numbers (from line {line} on) where {where}; for "
                                "timestamps in seconds use format: csv with time_column")
        if not self.datetimes:
            self.parts.append(_numeric(series, self.src))
            return
        try:
            with warnings.catch_warnings():  # pandas warns before it fails on text that is not a date
                warnings.simplefilter("ignore", UserWarning)
                try:  # naive stamps read as UTC; offsets may differ (DST)
                    ts = pd.to_datetime(series, utc=True)
                except (ValueError, TypeError):
                    # pandas takes one format from the first stamp; Python's isoformat drops zero
                    # microseconds, so '... 00:00:01' beside '... 00:00:01.100000' failed: each read alone
                    ts = pd.to_datetime(series, utc=True, format="mixed")
        except (ValueError, TypeError) as e:  # pandas' advice after the first sentence is about its own API
            why = str(e).splitlines()[0].split(". You might")[0]
            raise WorkloadError(f"{self.src}: neither seconds nor datetimes ({why})") from e
        if ts.isna().any():
            line = int(series.index[np.flatnonzero(ts.isna().to_numpy())[0]]) + 2
            raise WorkloadError(f"{self.src} has an empty timestamp (first at line {line})")
        self.parts.append(ts.dt.tz_localize(None).to_numpy())

    def seconds(self) -> np.ndarray:
        import pandas as pd

        if not self.parts:
            return np.zeros(0, dtype=np.float64)
        values = _joined(self.parts)
        if not self.datetimes:
            return values
        ts = pd.Series(values)
        del values
        return (ts - ts.min()).dt.total_seconds().to_numpy(dtype=np.float64)


def _clip_lengths(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Round to whole tokens and raise lengths < 1 to 1; returns (lengths, how many were raised)."""
    lengths = np.rint(values).astype(np.int64)
    return lengths, _raise_to_one(lengths)


def _raise_to_one(lengths: np.ndarray) -> int:
    """Raise lengths < 1 to 1 in place; returns how many were."""
    low = lengths < 1
    lengths[low] = 1
    return int(low.sum())


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The slices as one array, dropping them as it goes (a column is never held twice over)."""
    whole = np.concatenate(parts)
    parts.clear()
    return whole


@dataclass(slots=True)
class Trace:
    """A loaded trace, sorted by arrival. Times in seconds from the first kept request."""

    arrival_time: np.ndarray  # float64
    prompt_len: np.ndarray  # int64, >= 1
    output_len: np.ndarray  # int64, >= 1
    num_failed_dropped: int = 0  # BurstGPT rows with 0 response tokens
    num_prompt_clipped: int = 0  # prompt lengths < 1 raised to 1
    num_output_clipped: int = 0


def load_trace(cfg: TraceConfig, where: str = "workload.trace") -> Trace:
    """Read an Azure, BurstGPT or plain CSV trace into arrival times (s) and lengths (tokens),
    slice by slice (see :func:`_csv_chunks`); a file already in time order is not re-sorted."""
    tcol, pcol, ocol = cfg.columns()
    of = f"of {cfg.path}"
    times = _Seconds(f"{where}.time_column: column {tcol!r} {of}", cfg.format == "azure")
    prompts, outputs = [], []
    failed, skip = 0, cfg.start
    for df in _csv_chunks(cfg.path, {"time_column": tcol, "prompt_column": pcol, "output_column": ocol}, where):
        if skip:
            df, skip = df.iloc[skip:], max(0, skip - len(df))
        if df.empty:
            continue
        prompt = _numeric(df[pcol], f"{where}.prompt_column: column {pcol!r} {of}", INT_MAX, whole=True)
        output = _numeric(df[ocol], f"{where}.output_column: column {ocol!r} {of}", INT_MAX, whole=True)
        if cfg.format == "burstgpt":
            ok = output > 0
            failed += int((~ok).sum())
            df, prompt, output = df[ok], prompt[ok], output[ok]
        times.add(df[tcol])
        prompts.append(np.rint(prompt).astype(np.int64))  # whole tokens; raised to >= 1 once kept
        outputs.append(np.rint(output).astype(np.int64))
    t = times.seconds()
    if t.size == 0:
        raise WorkloadError(
            f"{where}: no requests left in {cfg.path} (start={cfg.start}, {failed} failed rows)"
        )
    prompt_len, output_len = _joined(prompts), _joined(outputs)
    # One column at a time, so the peak is the kept columns plus one (a few tens of bytes a row).
    if (t[1:] >= t[:-1]).all():  # a stable sort would not move a row
        t, prompt_len, output_len = t[: cfg.limit], prompt_len[: cfg.limit], output_len[: cfg.limit]
    else:
        order = np.argsort(t, kind="stable")[: cfg.limit]
        t = t[order]
        prompt_len = prompt_len[order]
        output_len = output_len[order]
        del order
    p_clipped, o_clipped = _raise_to_one(prompt_len), _raise_to_one(output_len)
    t = t - t[0]  # a new array: pandas' seconds can be a read-only view
    t *= cfg.time_scale
    return Trace(t, prompt_len, output_len, failed, p_clipped, o_clipped)


def mean_floor(dist: Any) -> float:
    """A floor under the mean of a length distribution, without drawing or reading anything, for
    checks that must not refuse a run that fits: a uniform's midpoint, half a (log)normal's mean
    clamped to [min, max] (its tails are redrawn, which moves the mean), a zipf's minimum, 1 for an
    empirical column."""
    if isinstance(dist, FixedLength):
        return float(dist.value)
    if isinstance(dist, UniformLength):
        return (dist.min + dist.max) / 2
    if isinstance(dist, NormalLength):  # lognormal too; clipped to [min, max]
        return float(min(max(dist.mean, dist.min), dist.max if dist.max is not None else math.inf)) / 2
    if isinstance(dist, ZipfLength):
        return float(dist.min)
    return 1.0


def check_files(cfg: WorkloadConfig) -> None:
    """Read every file the workload names, as generation will: a bad trace or length file is then
    one ``WorkloadError`` when the scenario loads, not a failure in each worker of a sweep or compare."""
    rng = np.random.default_rng(0)
    if cfg.trace is not None and cfg.trace.format == "mooncake":
        read_mooncake(cfg.trace.path, cfg.trace.time_scale, cfg.trace.start, cfg.trace.limit)
    elif cfg.trace is not None:
        load_trace(cfg.trace)
    if isinstance(cfg.arrival, TraceArrival):
        _arrival_times(cfg.arrival, None, None, rng)
    for where, dist in (("workload.prompt_len", cfg.prompt_len), ("workload.output_len", cfg.output_len)):
        if isinstance(dist, EmpiricalLength):
            _lengths(dist, 0, rng, where)


# --------------------------------------------------------------------------- sampling


def _arrival_field(arrival: Any) -> str:
    return "workload.arrival.time_scale" if isinstance(arrival, TraceArrival) else "workload.arrival.rate"


def _check_horizon(times: np.ndarray, where: str, fix: str) -> None:
    """Refuse arrivals past ``MAX_SIM_SECONDS``, where the float clock would lose the steps."""
    if times.size and not times.max() <= MAX_SIM_SECONDS:
        raise WorkloadError(f"{where}: the last request arrives at {float(times.max()):.3g} s of simulated time, past "
                            f"the {MAX_SIM_SECONDS:.0e} s up to which servesim's clock resolves a step ({fix})")


def _arrival_times(
    arrival: Any, n_max: int | None, duration: float | None, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times (s), sorted, at most n_max of them and all < duration where given."""
    if isinstance(arrival, TraceArrival):
        clock = _Seconds(f"workload.arrival.column: {arrival.column!r} of {arrival.path}", False)
        for df in _csv_chunks(arrival.path, {"column": arrival.column}, "workload.arrival"):
            clock.add(df[arrival.column])
        t = np.sort(clock.seconds())
        if t.size == 0:
            raise WorkloadError(f"workload.arrival.path: no rows in {arrival.path}")
        t = (t - t[0]) * arrival.time_scale
    elif isinstance(arrival, ConstantArrival):
        n = n_max if duration is None else math.ceil(duration * arrival.rate)
        t = np.arange(n if n_max is None else min(n, n_max), dtype=np.float64) / arrival.rate
    else:
        if isinstance(arrival, GammaArrival):
            k = arrival.shape

            def gaps(m: int) -> np.ndarray:
                return rng.gamma(k, 1.0 / (arrival.rate * k), m)
        else:

            def gaps(m: int) -> np.ndarray:
                return rng.exponential(1.0 / arrival.rate, m)

        if duration is None:
            t = np.cumsum(gaps(n_max))
        else:
            # Draw in chunks until past the horizon; successive draws continue one stream, so the
            # times do not depend on the chunk size.
            chunk = int(1.2 * duration * arrival.rate) + 64
            parts, end, count = [], 0.0, 0
            while end < duration and (n_max is None or count < n_max):
                m = chunk if n_max is None else min(chunk, n_max - count)
                part = end + np.cumsum(gaps(m))
                parts.append(part)
                end, count = float(part[-1]), count + m
            t = np.concatenate(parts)
    if duration is not None:
        t = t[t < duration]
    return t[:n_max]


def _lengths(dist: Any, n: int, rng: np.random.Generator, where: str) -> tuple[np.ndarray, list[str]]:
    """n lengths (int64 tokens, >= 1) and any notes about clipped input values."""
    if isinstance(dist, FixedLength):
        return np.full(n, dist.value, dtype=np.int64), []
    if isinstance(dist, UniformLength):
        return rng.integers(dist.min, dist.max, n, endpoint=True, dtype=np.int64), []
    if isinstance(dist, EmpiricalLength):
        src = f"{where}.column: {dist.column!r} of {dist.path}"
        parts = [_numeric(df[dist.column], src, INT_MAX) for df in _csv_chunks(dist.path, {"column": dist.column}, where)]
        pool, clipped = _clip_lengths(np.concatenate(parts) if parts else np.zeros(0))
        if pool.size == 0:
            raise WorkloadError(f"{where}.path: column {dist.column!r} of {dist.path} is empty")
        notes = []
        if clipped:
            notes.append(f"{where}: {clipped} of {pool.size} lengths in {dist.path} were < 1, raised to 1")
        return rng.choice(pool, n, replace=True), notes
    hi = dist.max if dist.max is not None else INT_MAX
    if isinstance(dist, ZipfLength):
        out = rng.zipf(dist.a, n)
        for _ in range(_ZIPF_ROUNDS):
            redo = out > dist.max - dist.min + 1
            if not redo.any():
                break
            out[redo] = rng.zipf(dist.a, int(redo.sum()))
        return np.minimum(out + (dist.min - 1), dist.max).astype(np.int64), []
    if isinstance(dist, LognormalLength):
        # Moment matching: lengths with mean m and std s have log-mean mu and log-std sigma.
        sigma2 = math.log1p((dist.std / dist.mean) ** 2)
        raw = rng.lognormal(math.log(dist.mean) - sigma2 / 2, math.sqrt(sigma2), n)
    else:
        raw = rng.normal(dist.mean, dist.std, n)
    return np.clip(np.rint(raw), dist.min, hi).astype(np.int64), []


def _token_ids(
    prompt: np.ndarray,
    prefix_id: np.ndarray,
    prefix_len: np.ndarray,
    num_prefixes: int,
    vocab: int,
    rng: np.random.Generator,
) -> list[list[int]]:
    """Random prompt token ids; requests with the same prefix_id share their first prefix_len ids."""
    if prompt.size == 0:
        return []
    longest = int(prefix_len.max(initial=0))
    shared = rng.integers(0, vocab, (max(num_prefixes, 1), longest), dtype=np.int32)
    own = rng.integers(0, vocab, int((prompt - prefix_len).sum()), dtype=np.int32)
    bounds = np.cumsum(prompt - prefix_len)[:-1]
    return [
        (shared[pid, :plen].tolist() if plen else []) + body.tolist()
        for pid, plen, body in zip(
            prefix_id.tolist(), prefix_len.tolist(), np.split(own, bounds), strict=True
        )
    ]


class RequestArrays(Sequence[Request]):
    """A workload's requests as columns; each ``Request`` is made when it is read, so a run that
    reads them in arrival order holds only the ones in flight. Item i is request_id i; reading an
    item twice gives two fresh objects."""

    __slots__ = ("arrival_time", "prompt_len", "output_len", "prefix_id", "prefix_len", "token_ids")

    def __init__(self, arrival_time: np.ndarray, prompt_len: np.ndarray, output_len: np.ndarray,
                 prefix_id: np.ndarray, prefix_len: np.ndarray, token_ids: list[list[int]] | None = None) -> None:
        self.arrival_time = np.asarray(arrival_time, dtype=np.float64)
        self.prompt_len = np.asarray(prompt_len, dtype=np.int64)
        self.output_len = np.asarray(output_len, dtype=np.int64)
        self.prefix_id = np.asarray(prefix_id, dtype=np.int64)
        self.prefix_len = np.asarray(prefix_len, dtype=np.int64)
        self.token_ids = token_ids

    def __len__(self) -> int:
        return len(self.arrival_time)

    def __getitem__(self, i):  # type: ignore[override]  # noqa: ANN001, ANN204
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return Request(i, float(self.arrival_time[i]), int(self.prompt_len[i]), int(self.output_len[i]),
                       int(self.prefix_id[i]), int(self.prefix_len[i]), 0,
                       self.token_ids[i] if self.token_ids is not None else None)

    def __iter__(self) -> Iterator[Request]:
        token_ids = self.token_ids
        # Positional, in Request's field order; converted in chunks, not all at once.
        for lo in range(0, len(self), _CHUNK):
            hi = lo + _CHUNK
            cols = (self.arrival_time[lo:hi].tolist(), self.prompt_len[lo:hi].tolist(),
                    self.output_len[lo:hi].tolist(), self.prefix_id[lo:hi].tolist(),
                    self.prefix_len[lo:hi].tolist())
            ids = token_ids[lo:hi] if token_ids is not None else [None] * len(cols[0])
            for j, (t, p, o, pid, plen, tok) in enumerate(zip(*cols, ids, strict=True)):
                yield Request(lo + j, t, p, o, pid, plen, 0, tok)


_CHUNK = 8192


@dataclass(slots=True)
class Workload:
    """Generated requests plus what the user should know about how they were made."""

    requests: Sequence[Request]  # RequestArrays, or objects for sessions and Mooncake traces
    counts: dict[str, int] = field(default_factory=dict)  # failed rows dropped, lengths clipped
    notes: list[str] = field(default_factory=list)  # one line each, for the CLI to print

    def stats(self) -> dict[str, float]:
        """:func:`workload_stats` plus the drop/clip counts."""
        return {**workload_stats(self.requests), **self.counts}


def generate_workload(cfg: WorkloadConfig, seed: int) -> Workload:
    """Build the requests of ``cfg`` with the given seed, with counts of dropped/clipped trace rows.

    Requests are sorted by arrival_time (seconds) with request_id 0..N-1 in that order.
    Raises :class:`WorkloadError` for missing files or columns and empty traces.
    """
    streams = np.random.SeedSequence(seed).spawn(6)
    rng = [np.random.default_rng(s) for s in streams]
    counts: dict[str, int] = {}
    notes: list[str] = []
    if cfg.sessions is not None:
        return _session_workload(cfg, cfg.sessions, rng)
    if cfg.trace is not None and cfg.trace.format == "mooncake":
        return _mooncake_workload(cfg, cfg.trace)
    if cfg.trace is not None:
        tr = load_trace(cfg.trace)
        keep = tr.arrival_time < cfg.duration_s if cfg.duration_s is not None else slice(None)
        times, prompt, output = (
            a[keep][: cfg.num_requests] for a in (tr.arrival_time, tr.prompt_len, tr.output_len)
        )
        counts = {
            "num_failed_dropped": tr.num_failed_dropped,
            "num_prompt_clipped": tr.num_prompt_clipped,
            "num_output_clipped": tr.num_output_clipped,
        }
        src = f"workload.trace ({cfg.trace.path})"
        if tr.num_failed_dropped:
            notes.append(f"{src}: dropped {tr.num_failed_dropped} failed requests (0 response tokens)")
        for what, k in (("prompt", tr.num_prompt_clipped), ("output", tr.num_output_clipped)):
            if k:
                notes.append(f"{src}: {k} {what} lengths < 1 raised to 1")
        notes += _short_file_note(cfg, times.size, src)
    else:
        times = _arrival_times(cfg.arrival, cfg.num_requests, cfg.duration_s, rng[_ARRIVALS])
        if isinstance(cfg.arrival, TraceArrival):
            notes += _short_file_note(cfg, times.size, f"workload.arrival ({cfg.arrival.path})")
        prompt, p_notes = _lengths(cfg.prompt_len, times.size, rng[_PROMPT], "workload.prompt_len")
        output, o_notes = _lengths(cfg.output_len, times.size, rng[_OUTPUT], "workload.output_len")
        notes += p_notes + o_notes
    n = times.size
    if cfg.prefix is not None:
        has = rng[_PREFIX].random(n) < cfg.prefix.fraction
        ids = rng[_PREFIX].integers(0, cfg.prefix.num_prefixes, n)
        prefix_id = np.where(has, ids, -1)
        prefix_len = np.where(has, np.minimum(cfg.prefix.prefix_len, prompt), 0)
    else:
        prefix_id, prefix_len = np.full(n, -1), np.zeros(n, dtype=np.int64)
    for note in notes:
        log.warning(note)
    token_ids = None
    if cfg.token_ids:
        num_prefixes = cfg.prefix.num_prefixes if cfg.prefix is not None else 0
        token_ids = _token_ids(prompt, prefix_id, prefix_len, num_prefixes, cfg.vocab_size, rng[_TOKENS])
    if cfg.trace is not None:
        _check_horizon(times, "workload.trace.time_scale", "a smaller time_scale replays it faster")
    else:
        _check_horizon(times, _arrival_field(cfg.arrival), "more requests per second arrive sooner")
    reqs = RequestArrays(times, prompt, output, prefix_id, prefix_len, token_ids)
    return Workload(reqs, counts, notes)


def _short_file_note(cfg: WorkloadConfig, n: int, src: str) -> list[str]:
    """A note when a file gives fewer requests than ``num_requests`` asks for: the count is a cap,
    so the run is shorter than written, which the user should hear of."""
    if cfg.num_requests is None or n >= cfg.num_requests:
        return []
    within = " before workload.duration_s" if cfg.duration_s is not None else ""
    return [f"workload.num_requests is {cfg.num_requests}, but {src} has {n} requests{within}; simulating {n}"]


def generate_requests(cfg: WorkloadConfig, seed: int) -> list[Request]:
    """The requests of ``cfg`` as objects (see :func:`generate_workload`; drop/clip notes go to the log)."""
    # Each Request holds a list, so building 100k of them triggers cyclic-GC passes over the whole
    # heap (3x the build time, growing with what else is alive); nothing here forms a cycle.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return list(generate_workload(cfg, seed).requests)
    finally:
        if gc_was_enabled:
            gc.enable()


def _session_workload(cfg: WorkloadConfig, sc: SessionConfig, rng: list[np.random.Generator]) -> Workload:
    """Multi-turn sessions: starts from the arrival process, then turns, lengths and think times."""
    starts = _arrival_times(cfg.arrival, cfg.num_requests, cfg.duration_s, rng[_ARRIVALS])
    _check_horizon(starts, _arrival_field(cfg.arrival), "more sessions per second start sooner")
    turns, notes = _lengths(sc.turns, starts.size, rng[_SESSIONS], "workload.sessions.turns")
    total = int(turns.sum())
    new, p_notes = _lengths(cfg.prompt_len, total, rng[_PROMPT], "workload.prompt_len")
    reply, o_notes = _lengths(cfg.output_len, total, rng[_OUTPUT], "workload.output_len")
    if sc.think_time_dist == "exponential":
        think = rng[_SESSIONS].exponential(sc.think_time_s, total) if sc.think_time_s > 0 else np.zeros(total)
    else:
        think = np.full(total, sc.think_time_s)
    notes += p_notes + o_notes
    for note in notes:
        log.warning(note)
    return Workload(build_sessions(starts, turns, new, reply, think, sc.system_prompt_len), {}, notes)


def _mooncake_workload(cfg: WorkloadConfig, tc: TraceConfig) -> Workload:
    """A Mooncake JSONL trace: arrivals, lengths and 512-token block hashes as prefix-cache segments."""
    tr = read_mooncake(tc.path, tc.time_scale, tc.start, tc.limit)
    _check_horizon(tr.arrival_time, "workload.trace.time_scale", "a smaller time_scale replays it faster")
    keep = np.flatnonzero(tr.arrival_time < cfg.duration_s) if cfg.duration_s is not None else np.arange(
        tr.arrival_time.size)
    keep = keep[: cfg.num_requests].tolist()
    reqs = [Request(i, float(tr.arrival_time[k]), int(tr.prompt_len[k]), int(tr.output_len[k]),
                    segments=tr.segments[k]) for i, k in enumerate(keep)]
    counts = {"num_prompt_beyond_hashes": tr.num_prompt_beyond_hashes}
    notes = []
    if tr.num_prompt_beyond_hashes:
        notes.append(f"workload.trace ({tc.path}): {tr.num_prompt_beyond_hashes} prompts run past their hash_ids; "
                     "those tokens are treated as the request's own")
    notes += _short_file_note(cfg, len(reqs), f"workload.trace ({tc.path})")
    for note in notes:
        log.warning(note)
    return Workload(reqs, counts, notes)


def workload_stats(requests: Sequence[Request]) -> dict[str, float]:
    """Summary for the CLI: count, duration (s, last arrival since t = 0), rate (requests/s),
    mean / p50 / p99 prompt and output lengths (tokens), share of requests with a prefix."""
    n = len(requests)
    if n == 0:
        return {"num_requests": 0, "duration_s": 0.0, "request_rate": 0.0}
    if isinstance(requests, RequestArrays):  # the columns themselves, no objects made
        cols = {"arrival_time": requests.arrival_time, "prompt_len": requests.prompt_len,
                "output_len": requests.output_len, "prefix_id": requests.prefix_id}
    else:
        cols = {name: np.fromiter((getattr(r, name) for r in requests), np.float64 if name == "arrival_time"
                                  else np.int64, n) for name in ("arrival_time", "prompt_len", "output_len", "prefix_id")}
    t = cols["arrival_time"]
    out: dict[str, float] = {"num_requests": n, "duration_s": float(t.max())}
    out["request_rate"] = n / out["duration_s"] if out["duration_s"] > 0 else math.inf
    for name in ("prompt_len", "output_len"):
        v = cols[name]
        out[f"mean_{name}"] = float(v.mean())
        out[f"p50_{name}"] = float(np.percentile(v, 50))
        out[f"p99_{name}"] = float(np.percentile(v, 99))
        out[f"total_{name}"] = int(v.sum())
    out["prefix_fraction"] = int(np.count_nonzero(cols["prefix_id"] >= 0)) / n
    return out
