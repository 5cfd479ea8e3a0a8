"""A GPU without a preset, described in a YAML (or JSON) file of ``HardwareConfig`` fields.

``hardware: gpus/l4.yaml`` in a scenario (or ``--set hardware=...``) prices that GPU. The file maps
field names of ``HardwareConfig`` (``sim/presets.py``) to values; ``base: PRESET`` starts from that
preset's figures (its measured fractions, link and FlashAttention version) and the file overrides
what differs, else every field the file leaves out takes ``HardwareConfig``'s default, the figures
for hardware nobody profiled, and the datasheet peaks are required::

    base: l40s                  # optional
    name: l4                    # optional: the file's name
    peak_flops: 121 TFLOPS      # dense BF16, FLOP/s
    hbm_bandwidth: 300 GB/s
    memory_bytes: 22.5 GiB      # nvidia-smi's total

A file that gives ``memory_bytes`` (nvidia-smi's total) but not ``cuda_memory_bytes`` gets CUDA's
total 512 MiB below it, the rule of the presets whose CUDA total nobody measured.

A number may carry a unit (``GiB``, ``MB``, ``TB/s``, ``TFLOPS``, ``us``, ``ms``) or be plain SI
(bytes, bytes/s, FLOP/s, seconds); an unknown field, a unit of the wrong kind, a negative figure or a
fraction outside (0, 2] is a one-line ``PresetError`` naming the file and the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import PresetError
from .hints import did_you_mean
from .mapping_file import cached_on_file, read_mapping

SUFFIXES = (".yaml", ".yml", ".json")
_BYTES = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1024.0, "mib": 1024.0**2, "gib": 1024.0**3, "tib": 1024.0**4}
_UNITS: dict[str, tuple[str, float]] = {
    **{u: ("bytes", f) for u, f in _BYTES.items()},
    **{f"{u}/s": ("bytes/s", f) for u, f in _BYTES.items()},
    **{u: ("flop/s", f) for u, f in (("flops", 1.0), ("gflops", 1e9), ("tflops", 1e12), ("pflops", 1e15))},
    **{u: ("s", 1 / d) for u, d in (("s", 1.0), ("ms", 1e3), ("us", 1e6), ("ns", 1e9))},
}
# what each field's unit must measure (fields not named here take plain numbers)
_KIND = {"peak_flops": "flop/s", "hbm_bandwidth": "bytes/s", "pcie_bandwidth": "bytes/s",
         "interconnect_bandwidth": "bytes/s", "memory_bytes": "bytes", "cuda_memory_bytes": "bytes",
         "non_torch_bytes": "bytes", "tp_non_torch_bytes": "bytes", "l2_bytes": "bytes",
         "allreduce_latency_s": "s", "allreduce_hop_latency_s": "s", "kernel_floor_s": "s",
         "fa2_decode_tile_s": "s", "fa2_decode_merge_s": "s"}
DRIVER_RESERVE_BYTES = 512 * 1024**2  # nvidia-smi's total less CUDA's: 317-637 MiB on six cards, median 490
_REQUIRED = ("peak_flops", "hbm_bandwidth", "memory_bytes")  # without a base
_POSITIVE = ("peak_flops", "hbm_bandwidth", "memory_bytes", "cuda_memory_bytes", "pcie_bandwidth",
             "interconnect_bandwidth", "price_per_gpu_hour", "l2_bytes", "fa2_decode_tile_s")
_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*$")


def is_hardware_file(name: str) -> bool:
    """Whether a ``hardware`` value names a file rather than a preset (presets hold no ``/`` and do
    not end in .yaml, .yml or .json)."""
    return "/" in name or "\\" in name or name.lower().endswith(SUFFIXES)


def hardware_fields(name: str, kinds: Mapping[str, tuple[str, bool]], presets: Mapping[str, Any]) -> dict[str, Any]:
    """The ``HardwareConfig`` fields the file at ``name`` gives, its base's filled in: ``kinds`` maps
    each field to (``float`` / ``int`` / ``str``, whether None is allowed), ``presets`` the presets a
    ``base`` may name (``HardwareConfig`` objects). Re-read when the file changes."""
    p = Path(name).expanduser()
    if not p.is_file():
        what = "a folder" if p.is_dir() else "no such file" if not p.exists() else "not a regular file"
        raise PresetError(f"hardware file {name!r}: {what}; give a hardware preset name or the path of a YAML "
                          "file of HardwareConfig fields (README: A GPU without a preset)")
    raw = dict(_read(p))
    where = f"hardware file {p}"
    base = raw.pop("base", None)
    fields: dict[str, Any] = {}
    if base is not None:
        if not isinstance(base, str) or base not in presets:
            raise PresetError(f"{where}: base {base!r} is no hardware preset{did_you_mean(str(base), presets)}; "
                              f"choose one of: {', '.join(sorted(presets))}")
        fields = {k: getattr(presets[base], k) for k in kinds}
    else:
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise PresetError(f"{where}: field {missing[0]!r} is missing; without a 'base' preset the file gives "
                              f"{', '.join(_REQUIRED)}")
    fields["name"] = p.stem.lower()
    for key, value in raw.items():
        if key not in kinds:
            raise PresetError(f"{where}: unknown field {key!r}{did_you_mean(str(key), kinds)}; the fields are "
                              f"base and those of HardwareConfig ({', '.join(k for k in kinds if k != 'name')})")
        fields[key] = _value(key, value, kinds[key], where)
    if "memory_bytes" in raw and "cuda_memory_bytes" not in raw:
        # CUDA's total is not the base's (nor nvidia-smi's): the driver's share, as for the presets
        # nobody measured, is taken to be 512 MiB
        if fields["memory_bytes"] <= DRIVER_RESERVE_BYTES:
            raise PresetError(f"{where}: memory_bytes ({fields['memory_bytes'] / 2**20:.1f} MiB) is no more than "
                              "the 512 MiB the driver is taken to keep of it; give nvidia-smi's total in "
                              "memory_bytes, or CUDA's own total in cuda_memory_bytes as well")
        fields["cuda_memory_bytes"] = fields["memory_bytes"] - DRIVER_RESERVE_BYTES
    cuda, total = fields.get("cuda_memory_bytes"), fields.get("memory_bytes")
    if cuda is not None and total is not None and cuda > total:
        raise PresetError(f"{where}: cuda_memory_bytes ({cuda / 2**30:.3f} GiB) is more than memory_bytes "
                          f"({total / 2**30:.3f} GiB); CUDA's total is the smaller, the driver keeps some of nvidia-smi's")
    return fields


@cached_on_file
def _read(path: str) -> tuple[tuple[str, Any], ...]:
    raw = read_mapping(path, f"hardware file {path}",
                       "a hardware file is a mapping of fields (base, peak_flops, hbm_bandwidth, ...)")
    return tuple((str(k), v) for k, v in raw.items())


def _value(key: str, value: Any, kind: tuple[str, bool], where: str) -> Any:
    typ, optional = kind
    if value is None:
        if optional:
            return None
        raise PresetError(f"{where}: field {key!r} is null; it needs a value")
    if typ == "str":
        if not isinstance(value, str) or not value.strip():
            raise PresetError(f"{where}: field {key!r} is {value!r}; it must be text")
        return value.strip() if key != "name" else value.strip().lower()
    number = _number(key, value, where)
    if typ == "int":
        if number != int(number) or number < 1:
            raise PresetError(f"{where}: field {key!r} is {value!r}; it must be a whole number >= 1")
        if key == "flash_attention" and number not in (2, 3):
            raise PresetError(f"{where}: field 'flash_attention' is {value!r}; vLLM runs FlashAttention 2 or 3 "
                              "(null: not known)")
        return int(number)
    if key.endswith("_fraction") or key == "allreduce_efficiency":
        if not 0 < number <= 2:
            raise PresetError(f"{where}: field {key!r} is {value!r}; a fraction of the peak must be in (0, 2]")
    elif number < 0 or (number == 0 and key in _POSITIVE):
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be {'> 0' if key in _POSITIVE else '>= 0'}")
    return number


def _number(key: str, value: Any, where: str) -> float:
    want = _KIND.get(key)
    if isinstance(value, bool):
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be a number")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str) and (m := _NUMBER.match(value)):  # YAML reads 121e12 as text
        number, unit = float(m[1]), m[2].lower()
        if unit:
            if unit not in _UNITS:
                raise PresetError(f"{where}: field {key!r} is {value!r}: unknown unit {m[2]!r}")
            measures, factor = _UNITS[unit]
            if measures != want:
                raise PresetError(f"{where}: field {key!r} is {value!r}: {m[2]} is a unit of {measures}, but "
                                  f"{key} is {'a plain number' if want is None else 'in ' + want}")
            number = number / round(1 / factor) if factor < 1 else number * factor  # 5 us is 5e-06 exactly
    else:
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be a number"
                          f"{'' if want is None else f' (in {want}, or with a unit)'}")
    if not math.isfinite(number) or abs(number) > 1e30:
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be a finite number")
    return number
