"""Measured serving runs: what a real vLLM server did, request by request. ``read_run`` picks the reader
(``run_llmservingsim.py``, ``run_vllm_bench.py``; what they share is in ``run_files.py``).

Two formats:

- ``llmservingsim``: a folder as LLMServingSim ships its real vLLM runs (``bench/examples/<GPU>/<model>/``):
  ``requests.jsonl`` (one request a line: ``input_toks``, ``output_toks``, ``arrival_time`` on the
  client's wall clock, ``queued_ts``, ``scheduled_ts``, ``first_token_ts``, ``last_token_ts`` on the
  engine's monotonic clock, seconds), ``meta.json`` (model, vLLM version, engine kwargs), and
  optionally ``llmservingsim_config.json`` (the GPU) and ``llmservingsim_summary.txt`` (LLMServingSim's
  own error on the run). That is the flat layout of the copies in shared/data; a harness output
  directory and LLMServingSim's committed examples (the vLLM files in ``vllm/``, the cluster config
  as ``config.json``) are read too (``run_llmservingsim._layout``).
- ``vllm-bench``: the JSON ``vllm bench serve --save-result --save-detailed`` writes
  (``vllm/benchmarks/serve.py``): ``input_lens``, ``output_lens``, ``ttfts``, ``itls`` and, in
  recent versions, ``start_times`` (the client's ``perf_counter`` at send) and ``latencies``; plus
  ``model_id``, ``request_rate``, ``burstiness``, ``max_concurrency``. It is the client's view only:
  no engine settings, no GPU.

Clocks. ``arrival_time`` and the engine timestamps come from two clocks with an unknown offset.
Each request's ``queued_ts - arrival_time`` is that offset plus the request's transport (HTTP,
tokenisation, IPC) plus the wait until the engine's busy loop next drains its input queue, which
happens between steps. The smallest of them over the run is the offset plus the bare transport
of a request that found the engine between steps; every client arrival is moved onto the engine
clock by that one constant. TTFT and E2E are then measured from that engine-side arrival, like
the simulator measures them (a request arriving during a step waits for the next one in both).
LLMServingSim measures from ``queued_ts`` instead, which leaves out the wait for the step
boundary; both figures are kept (``ttft_from_queued``).
"""

from __future__ import annotations

from pathlib import Path

from servesim.sim.hints import did_you_mean
from servesim.sim.presets import hardware_preset

from .run_files import (
    MeasuredRun,
    RunFileError,
    model_preset,
    unknown_hardware_message,
    unknown_model_message,
)
from .run_llmservingsim import read_llmservingsim, read_llmservingsim_summary
from .run_vllm_bench import read_vllm_bench

__all__ = ["FORMATS", "MeasuredRun", "RunFileError", "hardware_preset", "model_preset", "read_llmservingsim",
           "read_llmservingsim_summary", "read_run", "read_vllm_bench", "unknown_hardware_message",
           "unknown_model_message"]

FORMATS = ("llmservingsim", "vllm-bench")


def read_run(path: str | Path, fmt: str | None = None) -> MeasuredRun:
    """Read a measured run; ``fmt`` None guesses it (a folder: llmservingsim, a .json file: vllm-bench)."""
    p = Path(path)
    if fmt is None:
        if p.is_dir():
            fmt = "llmservingsim"
        elif p.suffix == ".json":
            fmt = "vllm-bench"
        elif not p.exists():
            raise RunFileError(f"{p}: not found")
        else:
            raise RunFileError(f"{p}: cannot tell the format; give --format ({', '.join(FORMATS)})")
    if fmt == "llmservingsim":
        run = read_llmservingsim(p)
    elif fmt == "vllm-bench":
        run = read_vllm_bench(p)
    else:
        raise RunFileError(f"unknown --format {fmt!r}{did_you_mean(fmt, FORMATS)}; use {' or '.join(FORMATS)}")
    if run.hardware is None and run.hardware_source:
        run.hardware = hardware_preset(run.hardware_source)
    return run
