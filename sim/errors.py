"""The errors a user can cause, and the one line each is reported as.

Every module that raises one imports it from here; the CLI (exit status 2, no traceback) and the
parallel workers (one line per failed task) both format them with ``one_line_error``, so neither
has to import the other.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """An error the user can fix; printed as one line, exit status 2."""


class ScenarioError(UserError, ValueError):
    """A problem with a scenario a user can fix; the message is one line."""


class WorkloadError(UserError, ValueError):
    """A workload the user asked for cannot be built (missing file or column, empty trace).

    The message is one line naming the config field and what to change; the CLI prints it
    without a traceback.
    """


class ProfileError(UserError, ValueError):
    """A cost-model profile that is missing or malformed."""


class PresetError(UserError, KeyError, ValueError):
    """An unknown preset name, or a model that does not fit the chosen hardware."""

    def __str__(self) -> str:
        # KeyError.__str__ would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


# What the user is to fix (a bad input, a missing file); anything else is a bug in servesim.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError)


def not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a data file (missing, a folder, a device or pipe such as
    /dev/null), or None when it is a regular file; a folder was reported as "file not found"."""
    if path.is_file():
        return None
    if path.is_dir():
        return f"{path} is a folder, not a file"
    if path.exists():
        return f"{path} is not a regular file (a device, pipe or socket)"
    return f"file not found: {path}"


def one_line_error(e: BaseException) -> str:
    """A user error's own first line; anything else prefixed with its type (a bug in servesim)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, USER_ERRORS):
        if isinstance(e, FileNotFoundError) and e.filename:
            return f"file not found: {e.filename}"
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
