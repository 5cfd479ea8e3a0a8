"""$ per GPU-hour for ``servesim search``: the hardware presets' defaults, overridden by ``--gpu-cost``.

``--gpu-cost`` is ``NAME=PRICE,...`` (repeatable) or the path of a YAML file mapping hardware
names to prices (``h100-sxm: 2.5``). Unknown names, non-numbers and prices <= 0 are one-line
errors naming the entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from ..errors import ScenarioError
from ..hints import did_you_mean
from ..presets import HARDWARE, get_hardware


def default_prices() -> dict[str, float]:
    """Each hardware preset's ``price_per_gpu_hour`` (presets without one are left out)."""
    return {name: hw.price_per_gpu_hour for name, hw in HARDWARE.items() if hw.price_per_gpu_hour is not None}


def parse_gpu_costs(items: Iterable[str]) -> dict[str, float]:
    """``--gpu-cost`` values -> {hardware: $ per GPU-hour}."""
    out: dict[str, float] = {}
    for item in items:
        path = Path(item)
        if "=" not in item and (path.suffix in (".yaml", ".yml", ".json") or path.is_file()):
            out.update(_from_file(path))
            continue
        for part in (p.strip() for p in item.split(",") if p.strip()):
            name, sep, text = part.partition("=")
            if not sep:
                raise ScenarioError(f"--gpu-cost {part!r}: expected HARDWARE=PRICE (e.g. h100-sxm=2.9) "
                                    "or a YAML file of hardware: price")
            out[name.strip()] = _price(name.strip(), text, "--gpu-cost")
    return out


def _from_file(path: Path) -> dict[str, float]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"--gpu-cost {path}: file not found") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ScenarioError(f"--gpu-cost {path}: not a YAML mapping of hardware: price ({type(exc).__name__})") from None
    if not isinstance(data, Mapping):
        raise ScenarioError(f"--gpu-cost {path}: expected a mapping like 'h100-sxm: 2.9', got {type(data).__name__}")
    return {str(k): _price(str(k), v, f"--gpu-cost {path}") for k, v in data.items()}


def _price(name: str, value: object, where: str) -> float:
    if name not in HARDWARE:
        raise ScenarioError(f"{where}: unknown hardware {name!r}{did_you_mean(name, HARDWARE)}; "
                            f"choose one of: {', '.join(sorted(HARDWARE))}")
    try:
        price = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ScenarioError(f"{where}: price of {name} must be a number of $ per GPU-hour, got {value!r}") from None
    if not (math.isfinite(price) and price > 0):
        raise ScenarioError(f"{where}: price of {name} must be > 0 $ per GPU-hour, got {value!r}")
    return price


def prices_for(hardware: Iterable[str], overrides: Mapping[str, float]) -> dict[str, float]:
    """The price of each hardware the search will use; a missing one is a one-line error."""
    table = {**default_prices(), **overrides}
    for h in hardware:  # a hardware file's own price_per_gpu_hour (sim/hardware_file.py)
        if h not in table and h not in HARDWARE and (price := get_hardware(h).price_per_gpu_hour) is not None:
            table[h] = price
    missing = sorted({h for h in hardware if h not in table})
    if missing:
        if missing[0] not in HARDWARE:
            raise ScenarioError(f"no $/GPU-hour for {missing[0]}: give its price_per_gpu_hour in that hardware file")
        raise ScenarioError(f"no $/GPU-hour for {', '.join(missing)}: give one with --gpu-cost "
                            f"{missing[0]}=PRICE (or a YAML file of hardware: price)")
    return {h: table[h] for h in hardware}
