"""Checks of a published source against the profile being imported from it: the GPU it names, and
that each op of a table is measured over the table's whole range (``calibration/gpu_import.py`` and
``calibration/gpu_composite.py`` both make them)."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
from servesim.sim.presets import hardware_preset

from .importers import SourceError


def check_hardware_matches(source_gpu: str, hardware: str, where: str) -> None:
    """The source was measured on the GPU --hardware names, where the source names a GPU servesim
    has a preset for; otherwise a ``SourceError`` naming both."""
    preset = hardware_preset(source_gpu) if source_gpu else None
    if preset is not None and preset != hardware:
        raise SourceError(f"{where} measures on {source_gpu!r} (preset {preset}), but --hardware is {hardware!r}; "
                          f"import it with --hardware {preset}")


def check_ops_cover(table: pd.DataFrame, where: str, ops: Iterable[str], axis: str) -> None:
    """``table`` (one column per op, indexed by ``axis``) spans two or more ``axis`` values and each of
    ``ops`` is measured at its first and last: between its points a curve is interpolated, beyond
    them it would be extrapolated flat from a shorter one. ``SourceError`` otherwise."""
    xs = table.index
    if len(xs) < 2:
        raise SourceError(f"{where}: measured at one {axis} value ({xs[0]}); a table needs at least two")
    for op in ops:
        got = table[op].dropna().index
        if got.min() > xs.min() or got.max() < xs.max():
            span = f"{got.min()}..{got.max()}" if len(got) > 1 else f"{got.min()} only"
            raise SourceError(f"{where}: op {op!r} is measured at {axis} {span}, the table at {xs.min()}..{xs.max()}; "
                              "give every op the whole range")
