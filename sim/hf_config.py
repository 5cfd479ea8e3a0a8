"""A model read from a Hugging Face ``config.json`` on disk, for models servesim has no preset for.

``model: /models/Qwen3-8B/config.json`` (or the folder that holds it) in a scenario, or ``--set
model=...``, prices that model's shapes. Nothing is downloaded: the file is the one a checkout of
the model, or the Hub's page for it, has. Only what servesim models is accepted: a dense
Llama-style decoder (``model_type`` llama, mistral, qwen2 or qwen3: RMSNorm, RoPE, GQA attention,
SwiGLU MLP) in 16-bit weights. A mixture-of-experts, quantised, sliding-window or other
architecture is a one-line ``PresetError`` naming the field, not a silently wrong price.

The fields read and their defaults are those of the ``transformers`` config classes of each
``model_type`` (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``); weights are
2 bytes (vLLM's ``dtype: auto`` serves a float32 checkpoint in 16 bits as well).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from .errors import PresetError
from .mapping_file import cached_on_file, read_mapping

# model_type -> (max_position_embeddings, rms_norm_eps, rope_theta) when the file omits them: the
# defaults of transformers' config class for that type
_DEFAULTS: dict[str, tuple[int, float, float]] = {
    "llama": (2048, 1e-6, 10000.0),
    "mistral": (4096 * 32, 1e-6, 10000.0),
    "qwen2": (32768, 1e-6, 10000.0),
    "qwen3": (32768, 1e-6, 10000.0),
}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_SNAPSHOT = re.compile(r"[0-9a-f]{40}")


def is_config_path(name: str) -> bool:
    """Whether a ``model`` value names a file or folder rather than a preset (preset names hold no
    path separator and do not end in ``.json``)."""
    return "/" in name or "\\" in name or name.lower().endswith(".json") or Path(name).is_dir()


def config_file(name: str | Path) -> Path:
    """The ``config.json`` a ``model`` value names: the file itself, or the one in that folder."""
    p = Path(name).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        what = "no such file" if not p.exists() else "not a regular file"
        raise PresetError(f"model config {str(name)!r}: {what} ({p}); give a model preset name or the path of a "
                          "Hugging Face config.json (or the folder holding it)")
    return p


def model_fields(name: str | Path) -> dict[str, Any]:
    """The ``ModelConfig`` fields (``sim/presets.py``) of the ``config.json`` at ``name`` (a file or
    its folder); re-read when the file changes. ``PresetError`` names the field that is missing,
    malformed or not modelled."""
    return dict(_load(config_file(name)))


@cached_on_file
def _load(path: str) -> tuple[tuple[str, Any], ...]:
    where = f"model config {path}"
    cfg = read_mapping(path, where, "a Hugging Face config.json is a JSON object of fields (model_type, "
                       "hidden_size, ...)", yaml_ok=False)
    return tuple(fields_from_config(cfg, where, name=_model_name(cfg, Path(path))).items())


def _model_name(cfg: dict[str, Any], path: Path) -> str:
    """What the model is called in reports and profile checks: the base of the config's
    ``_name_or_path`` when it has one, else the folder the file is in (a Hub cache's
    ``models--Org--Name/snapshots/<hash>/`` gives ``name``), lower-cased."""
    given = cfg.get("_name_or_path")
    if isinstance(given, str) and given.strip().rstrip("/"):
        base = given.strip().rstrip("/").replace("\\", "/").split("/")[-1]
    else:
        folder = path.parent
        if _SNAPSHOT.fullmatch(folder.name) and folder.parent.name == "snapshots":
            folder = folder.parent.parent
        base = folder.name.split("--")[-1] if folder.name.startswith("models--") else folder.name
        base = base or path.stem
    return base.lower()


def _whole(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = default if cfg.get(key) is None else cfg[key]
    if value is None:
        raise PresetError(f"{where}: field {key!r} is missing (a Llama-style config.json has it)")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value != int(value) or value < 1 or value > 2**31:
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be a whole number >= 1")
    return int(value)


def _positive(cfg: dict[str, Any], key: str, where: str, default: float) -> float:
    value = default if cfg.get(key) is None else cfg[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be a number > 0")
    return float(value)


def _flag(cfg: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = default if cfg.get(key) is None else cfg[key]
    if not isinstance(value, bool):
        raise PresetError(f"{where}: field {key!r} is {value!r}; it must be true or false")
    return value


def fields_from_config(cfg: dict[str, Any], where: str, name: str) -> dict[str, Any]:
    """``ModelConfig``'s fields from those of one Hugging Face config (see the module docstring)."""
    kind = cfg.get("model_type")
    if not isinstance(kind, str):
        raise PresetError(f"{where}: field 'model_type' is {'missing' if kind is None else repr(kind)}; servesim "
                          f"reads the dense Llama-style types: {', '.join(_DEFAULTS)}")
    moe = [k for k in _MOE_FIELDS if cfg.get(k) not in (None, 0, 1)]
    if "moe" in kind or kind in ("mixtral", "deepseek_v2", "deepseek_v3") or moe:
        field = f" (field {moe[0]!r} is {cfg[moe[0]]!r})" if moe else ""
        raise PresetError(f"{where}: model_type {kind!r} is a mixture-of-experts model{field}; servesim prices dense "
                          "decoders only, so its expert GEMMs and routing are not modelled")
    if kind not in _DEFAULTS:
        raise PresetError(f"{where}: model_type {kind!r} is not one servesim models; it reads the dense Llama-style "
                          f"decoders (RMSNorm, RoPE, GQA, SwiGLU): {', '.join(_DEFAULTS)}")
    if cfg.get("quantization_config") is not None:
        method = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) else None
        raise PresetError(f"{where}: the weights are quantised (quantization_config{f': {method}' if method else ''}); "
                          "servesim prices 16-bit weights only")
    window = cfg.get("sliding_window")
    if window is not None and _flag(cfg, "use_sliding_window", where, kind == "mistral"):
        raise PresetError(f"{where}: sliding-window attention (sliding_window {window!r}) is not modelled: servesim's "
                          "KV cache and attention keep every token; use a config without it")
    if cfg.get("hidden_act") not in (None, "silu", "swish"):
        raise PresetError(f"{where}: hidden_act {cfg['hidden_act']!r}: servesim models the SwiGLU MLP (silu)")
    max_pos, eps, theta = _DEFAULTS[kind]
    heads = _whole(cfg, "num_attention_heads", where)
    kv_heads = _whole(cfg, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise PresetError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    hidden = _whole(cfg, "hidden_size", where)
    if cfg.get("head_dim") is None and hidden % heads:
        raise PresetError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and "
                          "there is no head_dim field")
    rope = cfg.get("rope_parameters")  # newer transformers keep rope_theta in here
    if cfg.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        cfg = {**cfg, "rope_theta": rope["rope_theta"]}
    return dict(
        name=name,
        num_layers=_whole(cfg, "num_hidden_layers", where),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_whole(cfg, "head_dim", where, default=hidden // heads),
        intermediate_size=_whole(cfg, "intermediate_size", where),
        vocab_size=_whole(cfg, "vocab_size", where),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", where, False),
        rope_theta=_positive(cfg, "rope_theta", where, theta),
        rms_norm_eps=_positive(cfg, "rms_norm_eps", where, eps),
        max_position_embeddings=_whole(cfg, "max_position_embeddings", where, default=max_pos),
        qkv_bias=True if kind == "qwen2" else _flag(cfg, "attention_bias", where, False),
        qk_norm=kind == "qwen3",
    )
