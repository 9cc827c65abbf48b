"""Error types that carry a message meant for the user.

A ``UserError`` is raised for anything the user can fix (a config key, a file, a value).
The command-line tool prints its message on one line and exits with code 2, without a
traceback, unless ``--debug`` or ``SSL_ENGINE_DEBUG=1`` asks for one.
"""

import difflib
import errno
import os
import re
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

USER_ERROR_EXIT_CODE = 2
PREEMPTED_EXIT_CODE = 3
INTERRUPTED_EXIT_CODE = 130  # stopped by Ctrl-C / SIGINT (the shell's convention)


class UserError(Exception):
    """An error caused by the user's input, explained in its message."""


class ConfigError(UserError):
    """The composed configuration is invalid (unknown key, wrong type, bad value)."""


class CheckpointError(UserError):
    """A checkpoint file or folder cannot be used."""


# scheme://...: http(s), ftp, s3, gs, manifold (VISSL's iopath paths), file
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def whole_number(value: object) -> Optional[int]:
    """``value`` as an int where it is a whole number (4 and 4.0 alike; not True), else None: a
    count or size that a config gives as 4.5 is refused rather than cut to 4."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        return None
    return int(value)


def is_url(value: object) -> bool:
    """Whether a path value of the config is a URL (``scheme://...``) rather than a local path."""
    return isinstance(value, str) and _URL_RE.match(value.strip()) is not None


def url_error(key: str, value: str, output: bool = False) -> ConfigError:
    """The error for a URL given where ssl_engine needs a local path: ``key`` and the URL as given.

    VISSL downloads a PARAMS_FILE URL into CHECKPOINT.DIR/params_file_cache; ssl_engine runs
    without network access and never downloads (the README says so)."""
    if output:
        return ConfigError(f"{key}: {value} is a URL; ssl_engine writes only to local folders: set {key} to a local folder")
    return ConfigError(
        f"{key}: {value} is a URL; ssl_engine does not download files (no network access at run time): "
        f"fetch it first (e.g. wget or curl -o) and set {key} to the local path"
    )


def expand_user(value: object, key: str) -> Path:
    """``value`` as a path with a leading ``~`` or ``~user`` expanded to that home folder.

    ``Path.expanduser`` raises a bare RuntimeError for ``~name`` when this machine has no user
    ``name``; here that is a ConfigError naming ``key`` (the config key or option that gave it)."""
    text = str(value)
    expanded = os.path.expanduser(text)
    if text.startswith("~") and expanded == text:
        user = text[1:].split("/", 1)[0]
        whose = f"user {user!r}, whom this machine does not know" if user else "this user, and HOME is not set"
        raise ConfigError(f"{key}={text}: '~{user}' names the home folder of {whose}; write the path out in full")
    return Path(expanded)


def does_not_exist(key: str, value: object) -> str:
    """``<key>: '<value>' does not exist``, saying so when the value is a placeholder that a
    shipped config leaves for the user to fill in (VISSL's ``<path to train folder>``,
    ``specify the model weights``)."""
    text = str(value)
    placeholder = re.search(r"<[^<>]*>", text) is not None or (" " in text.strip() and "/" not in text)
    hint = f" (a placeholder of the config file: set {key.split('[')[0]} to your path)" if placeholder else ""
    return f"{key}: {text!r} does not exist{hint}"


_KILLED_WORKER = re.compile(r"DataLoader worker \(pid\(?s?\)? ([0-9, ]+)\) (?:is killed by signal: ([^.\n]+)|exited unexpectedly)")


_CUT_HANDOVER = re.compile(r"^(?:EOFError|ConnectionResetError|ConnectionRefusedError|BrokenPipeError)\b.*$")
_WORKER_DIED_ADVICE = ("if the system ran out of memory, lower config.DATA.NUM_DATALOADER_WORKERS or the batch size; "
                       "rerun the same command to resume")


def killed_worker_line(text: str) -> Optional[str]:
    """One line for torch's error of a loader worker that died (the kernel's OOM killer, a kill by
    hand), found in an exception's traceback text or a rank's; None for any other error.

    A worker killed while it hands a batch over cuts the connection the batch travels on: the
    loader reads an EOFError or ConnectionResetError in its own code before torch notices the
    worker is gone. Such an error raised in torch's loader (and not re-raised from a worker,
    whose errors say "in DataLoader worker process") is the same death."""
    m = _KILLED_WORKER.search(text)
    if m is not None:
        how = f"was killed by signal {m.group(2).strip()}" if m.group(2) else "exited unexpectedly"
        return f"loader worker (pid {m.group(1).strip()}) {how}; {_WORKER_DIED_ADVICE}"
    if "torch/utils/data/dataloader.py" not in text or "in DataLoader worker process" in text:
        return None
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or not _CUT_HANDOVER.match(lines[-1]):
        return None
    return f"a loader worker ended while it handed a batch over ({lines[-1]}); {_WORKER_DIED_ADVICE}"


def quiet_killed_worker_echoes(rank: bool = False) -> None:
    """torch's SIGCHLD handler raises the killed-worker error wherever the process is, also inside
    a callback, where Python can only print it as "Exception ignored in ..." with a traceback. The
    training loop raises the same error next, and it is reported once, in one line (see
    :func:`killed_worker_line`): leave those echoes out of stderr. In a spawned ``rank`` the same
    goes for a KeyboardInterrupt: the launcher's request to stop after another rank failed (it
    kills a rank that goes on), whose cause the launcher reports."""
    import sys

    previous = sys.unraisablehook

    def hook(unraisable: "sys.UnraisableHookArgs") -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and killed_worker_line(str(unraisable.exc_value)):
            return
        if rank and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        previous(unraisable)

    sys.unraisablehook = hook


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stops without checkpointing that state."""


class FolderLockedError(UserError):
    """Another run holds the checkpoint folder's lock (see ssl_engine.lock)."""


# torch re-raises an exception of a DataLoader worker in the main process as
# "Caught <Name> in DataLoader worker process <k>.\nOriginal Traceback ...\n<module>.<Name>: <message>".
_WORKER_WRAP = re.compile(
    r"Caught (?P<name>\w+) in DataLoader worker process (?P<worker>\d+)\.\s*Original Traceback \(most recent call last\):",
)


# errors of the file system a user fixes (a folder where a file should be, no permission, a full
# or read-only disk), not defects of the engine
_USERS_OS_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EISDIR", "ENOTDIR", "EACCES", "EPERM", "ENOSPC", "EROFS", "EDQUOT", "ENAMETOOLONG")
    if hasattr(errno, name)
)


def file_system_error(error: BaseException) -> Optional[UserError]:
    """The UserError for an OSError on a named file that the user's setup caused (see
    ``_USERS_OS_ERRNOS``), e.g. a folder named ``stdout.json`` in the checkpoint folder, or a
    file the run writes whose folder was deleted under it; None for any other error."""
    if not isinstance(error, OSError) or not error.filename:
        return None
    if error.errno == errno.ENOENT:
        return folder_gone(str(error.filename))
    if error.errno in _USERS_OS_ERRNOS:
        fix = {errno.EISDIR: "; it is a folder where the run writes a file: move it away",
               errno.ENOTDIR: "; a part of that path is a file where a folder belongs: move it away",
               errno.ENOSPC: "; free some space", errno.EROFS: "; use a writable folder",
               errno.EACCES: "; give the run access to it, or use another folder",
               errno.EPERM: "; give the run access to it, or use another folder"}.get(error.errno, "")
        return UserError(f"cannot use {error.filename}: {error.strerror or type(error).__name__}{fix}")
    return None


def folder_gone(path: str, known: bool = False) -> Optional[UserError]:
    """A UserError when the folder of ``path`` (a file the run writes) no longer exists: it was
    deleted or moved while the run used it, and its earlier files with it; None otherwise.
    ``known``: the caller saw the folder vanish (a write in it failed with ENOENT), so the error
    is given even while a deletion still in progress leaves the folder in place."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not known and os.path.isdir(folder):
        return None
    return UserError(f"cannot use {os.path.basename(path)}: its folder {folder} is gone (deleted or moved while the "
                     f"run was using it, with the files written there); rerun the command to start again")


def unwrap_worker_error(text: str) -> str:
    """The original message of an error that torch wrapped on its way out of a DataLoader worker.

    Text before the wrapper (e.g. the launcher's "rank 1: ") is kept; text that was not
    wrapped comes back unchanged.
    """
    m = _WORKER_WRAP.search(text)
    if not m:
        return text
    rest = text[m.end():]
    line = re.compile(rf"^(?:[\w.]+\.)?{re.escape(m.group('name'))}: ?(?P<msg>.*)$", re.M)
    hits = list(line.finditer(rest))
    if not hits:
        return text
    inner = rest[hits[-1].start("msg"):]
    return text[: m.start()] + unwrap_worker_error(inner)


def one_line(text: str) -> str:
    """An error text as the single line the command-line tool prints."""
    return " ".join(unwrap_worker_error(str(text)).split())


def first_few(items: Sequence[object], limit: int = 5, quote: bool = True) -> str:
    """``'a', 'b', 'c' and 2 more``: the first ``limit`` items of a list for a message (repr'd
    when ``quote``), and how many are left out."""
    shown = ", ".join(repr(x) if quote else str(x) for x in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def closest(name: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.5) -> List[str]:
    """The candidates closest to ``name``, best first (case-insensitive)."""
    cands = list(candidates)
    lower = {c.lower(): c for c in cands}
    hits = difflib.get_close_matches(name.lower(), list(lower), n=n, cutoff=cutoff)
    return [lower[h] for h in hits]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean X?)' suffix, or '' when nothing is close."""
    hits = closest(name, candidates)
    return f" (did you mean {', '.join(repr(h) for h in hits)}?)" if hits else ""
