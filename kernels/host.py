"""Host-side settings that make CPU step times steady: glibc's allocator kept from returning memory.

Each PyTorch CPU step allocates and frees activation buffers of a few MB. By default glibc serves
blocks over 128 KiB (adaptively up to 32 MiB) with fresh ``mmap`` calls and trims the heap top
when it is freed, so every step pays page faults to zero new pages: on this project's 2-core VM
that was ~30 % of step time as system CPU and the largest source of step-to-step jitter
(352k vs 72k minor faults over the same 200 steps). ``keep_heap`` raises the mmap and trim
thresholds with ``mallopt`` so freed buffers are reused. Calibration and live mode both call it,
so a fitted profile and the live run it predicts see the same allocator behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_done = False


def keep_heap() -> bool:
    """Tune glibc malloc once per process (a no-op elsewhere); True when the settings took."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    ok = all(libc.mallopt(opt, value) == 1 for opt, value in (
        (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's maximum: blocks under 32 MiB come from the heap
        (_M_TRIM_THRESHOLD, 1 << 30),  # keep up to 1 GiB of freed heap instead of returning it
        (_M_TOP_PAD, 64 << 20),  # grow the heap in 64 MiB steps
    ))
    _done = ok
    return ok
