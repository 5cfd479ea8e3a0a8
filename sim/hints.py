"""The "did you mean" suffix of error messages that name an unknown key or preset."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``word``, or ``""`` if none is close.

    A choice that ``word`` begins (``h100`` -> ``h100-sxm``) beats a merely similar one (``h200``).
    """
    word, choices = str(word), list(choices)
    close = sorted((c for c in choices if c.startswith(word) and word), key=len)[:1]
    close = close or difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
