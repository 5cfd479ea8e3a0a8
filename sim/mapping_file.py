"""Reading a small file of named fields (a model's ``config.json``, a hardware file) into a dict,
with the one-line errors every such file gets, and a cache that re-reads it when it changes."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import PresetError

T = TypeVar("T")


def read_mapping(path: str, where: str, shape: str, *, yaml_ok: bool = True) -> dict[Any, Any]:
    """The JSON object (a ``.json`` path, or any path without ``yaml_ok``) or YAML mapping in the file
    at ``path``. Anything else is a one-line ``PresetError`` starting ``where:``; ``shape`` says what
    the file should hold."""
    json_file = not yaml_ok or path.lower().endswith(".json")
    kind = "JSON" if json_file else "YAML"
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise PresetError(f"{where}: not UTF-8 text; {shape}") from None
    try:
        raw = json.loads(text) if json_file else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise PresetError(f"{where}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except yaml.YAMLError as e:
        raise PresetError(f"{where}: not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise PresetError(f"{where}: not valid {kind}: nested too deeply") from None
    if not isinstance(raw, dict) or not raw:
        raise PresetError(f"{where}: {shape}")
    return raw


def cached_on_file(fn: Callable[[str], T]) -> Callable[[Path], T]:
    """``fn(path)`` for a file, remembered until the file's size or modification time changes."""
    @lru_cache(maxsize=64)
    def cached(path: str, _mtime_ns: int, _size: int) -> T:
        return fn(path)

    def call(p: Path) -> T:
        p = p.resolve()
        st = p.stat()
        return cached(str(p), st.st_mtime_ns, st.st_size)
    return call
