"""Error types that carry a message meant for the user.

A ``UserError`` is raised for anything the user can fix (a config key, a file, a value).
The command-line tool prints its message on one line and exits with code 2, without a
traceback, unless ``--debug`` or ``SSL_ENGINE_DEBUG=1`` asks for one.
"""

import difflib
from typing import Iterable, List

USER_ERROR_EXIT_CODE = 2
PREEMPTED_EXIT_CODE = 3


class UserError(Exception):
    """An error caused by the user's input, explained in its message."""


class ConfigError(UserError):
    """The composed configuration is invalid (unknown key, wrong type, bad value)."""


class CheckpointError(UserError):
    """A checkpoint file or folder cannot be used."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stops without checkpointing that state."""


def closest(name: str, candidates: Iterable[str], n: int = 3) -> List[str]:
    """The candidates closest to ``name``, best first (case-insensitive)."""
    cands = list(candidates)
    lower = {c.lower(): c for c in cands}
    hits = difflib.get_close_matches(name.lower(), list(lower), n=n, cutoff=0.5)
    return [lower[h] for h in hits]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean X?)' suffix, or '' when nothing is close."""
    hits = closest(name, candidates)
    return f" (did you mean {', '.join(repr(h) for h in hits)}?)" if hits else ""
