"""Readers for public per-kernel GPU measurements (``servesim calibrate import``).

One module per published format, each returning tidy pandas frames in SI units (seconds, tokens,
bytes) plus the provenance a shipped profile must keep (source repository, commit, path inside it,
license, GPU):

- ``llmservingsim``: casys-kaist/LLMServingSim profiles (``meta.yaml`` + ``tp<N>/dense.csv``,
  ``attention.csv``, ``per_sequence.csv``, ``skew.csv``) and the older v0 ``layers.csv``.
- ``vidur``: microsoft/vidur ``compute/.../mlp.csv`` and ``network/.../all_reduce.csv``.
- ``inference_sim``: inference-sim/inference-sim ``mha_{decode,prefill}_*.csv``.

A malformed file raises ``SourceError`` (a ``ProfileError``, so the CLI prints it on one line and
exits 2) naming the file and what is wrong with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from servesim.sim.cost_model import ProfileError


class SourceError(ProfileError):
    """A measurement file that cannot be read: missing, or a column/field absent or not numeric."""


@dataclass(frozen=True)
class Origin:
    """Where a published data set comes from (SOURCES.md's table)."""

    repo: str
    commit: str
    license: str
    copyright: str


LLMSERVINGSIM = Origin("casys-kaist/LLMServingSim", "5daddb21a545", "MIT", "(c) 2024 CASYS Lab at KAIST")
VIDUR = Origin("microsoft/vidur", "7d47513363ec", "MIT", "(c) Microsoft Corporation")
INFERENCE_SIM = Origin("inference-sim/inference-sim", "a410740f69ca", "Apache-2.0", "inference-sim authors")


@dataclass(frozen=True)
class Provenance:
    """One source file behind a profile: the repository it was published in and what it measured."""

    repo: str
    commit: str
    path: str  # the file's path inside ``repo`` at ``commit``
    license: str
    copyright: str
    gpu: str
    local_path: str  # where it was read from here
    what: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def provenance(origin: Origin, source_path: str, local: Path, gpu: str, what: str = "") -> Provenance:
    return Provenance(origin.repo, origin.commit, source_path, origin.license, origin.copyright, gpu,
                      str(local), what)


def read_csv(path: str | Path, columns: list[str] | tuple[str, ...]) -> pd.DataFrame:
    """A CSV with at least ``columns``, numeric where the caller says so; ``SourceError`` otherwise."""
    path = Path(path)
    if why := not_a_file(path):
        raise SourceError(f"{path}: {why}")
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path}: cannot parse as CSV: {exc}") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise SourceError(f"{path}: missing column {missing[0]!r} (has: {', '.join(map(str, df.columns))})")
    if df.empty:
        raise SourceError(f"{path}: no data rows")
    return df


def not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a data file, or None when it is a regular file."""
    if path.is_file():
        return None
    if path.is_dir():
        return "a folder, not a file"
    return "not a regular file (a device, pipe or socket)" if path.exists() else "file not found"


def numeric(df: pd.DataFrame, path: str | Path, columns: list[str] | tuple[str, ...],
            positive: list[str] | tuple[str, ...] = (), whole: list[str] | tuple[str, ...] = ()) -> pd.DataFrame:
    """``df`` with ``columns`` as floats; a non-numeric, infinite or negative cell is a ``SourceError``,
    and so is 0 in a ``positive`` column (a time: no kernel takes none; a count of tokens, rows or
    bytes that measures nothing at 0) and a fraction in a ``whole`` one (a count, read as an int)."""
    out = df.copy()
    for c in columns:
        values = pd.to_numeric(out[c], errors="coerce")
        least = ">" if c in positive else ">="
        bad = values.isna() | (values <= 0 if c in positive else values < 0) | (values == float("inf"))
        if c in whole:
            bad |= values % 1 != 0
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            cell = out[c].iloc[row]
            shown = repr(cell) if isinstance(cell, str) else str(cell)  # text quoted; nan, -5.0 as read
            kind = "whole" if c in whole else "finite"
            raise SourceError(f"{path}: column {c!r} row {row + 2} is {shown}, expected a {kind} number {least} 0")
        out[c] = values.astype(float)
    return out


def one_row_per_shape(df: pd.DataFrame, path: str | Path, keys: list[str] | tuple[str, ...],
                      value: str) -> pd.DataFrame:
    """``df`` (as ``read_csv`` numbered it) with a row repeated as it is kept once; two rows of one
    shape (``keys``) with different ``value`` are a ``SourceError``: a format that times each shape
    once cannot say which to believe, and a mean of them is neither."""
    keys = list(keys)
    dup = df[df.duplicated(keys, keep=False)]
    for _, rows in dup.groupby(keys, sort=False):
        other = rows[rows[value] != rows[value].iloc[0]]
        if len(other):
            shape = ", ".join(f"{k}={_shown(rows[k].iloc[0])}" for k in keys)
            raise SourceError(f"{path}: rows {rows.index[0] + 2} and {other.index[0] + 2} both measure {shape} with "
                              f"different {value} ({_shown(rows[value].iloc[0])} vs {_shown(other[value].iloc[0])}); "
                              "keep one row per shape")
    return df.drop_duplicates(keys)


def _shown(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def after(path: Path, marker: str) -> str:
    """The part of ``path`` after the folder called ``marker`` ('' when there is none)."""
    parts = path.resolve().parts
    if marker in parts:
        i = len(parts) - 1 - parts[::-1].index(marker)
        return "/".join(parts[i + 1:])
    return ""
