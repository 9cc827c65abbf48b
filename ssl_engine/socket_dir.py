"""A folder short enough for the sockets that Python's multiprocessing binds.

Loader workers hand each batch's tensors to their rank as file descriptors, sent through a
socket that multiprocessing binds at ``<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX``; a
forkserver listens at such a path too. Linux holds at most 107 bytes in a socket's path.
Under a longer temp dir (a cluster's per-job TMPDIR, say) the bind fails inside the worker's
queue thread, which prints ``OSError: AF_UNIX path too long`` and drops the batch, and the
rank waits for that batch forever. So before any worker or forkserver starts, multiprocessing
is given its folder in a short standard place (only its sockets live there; everything else
still goes to TMPDIR), and where there is none the run stops with a message saying so.
Torch-free: the thread that starts the forkserver early checks with it while torch imports.
"""

import logging
import os
import tempfile
from typing import Optional, Sequence

from ssl_engine.errors import UserError

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107  # bytes in sockaddr_un.sun_path (108) less the terminating NUL
SHORT_BASES = ("/tmp", "/var/tmp", "/dev/shm")
_LISTENER = "listener-" + "x" * 8  # the name multiprocessing gives a socket: tempfile.mktemp's 8 characters
_PYMP = "pymp-" + "x" * 8  # and its folder: tempfile.mkdtemp's


def socket_path_fits(folder: str, in_pymp: bool = True) -> bool:
    """Whether a multiprocessing socket under ``folder`` (inside a new pymp-* folder there when
    ``in_pymp``) stays within Linux's limit."""
    parts = [folder, _PYMP, _LISTENER] if in_pymp else [folder, _LISTENER]
    return len(os.fsencode(os.path.join(*parts))) <= MAX_SOCKET_PATH


def ensure_short_socket_dir(bases: Sequence[str] = SHORT_BASES) -> Optional[str]:
    """Make multiprocessing's socket folder short enough; returns it where this call moved it.

    Nothing changes where the temp dir is short enough (the usual case). Otherwise
    multiprocessing's folder is created under the first writable folder of ``bases`` that
    fits, with a warning. Children (ranks, loader workers, forkserver children) inherit the
    folder with their process object. Raises UserError when no folder fits. Idempotent. Call
    it from the main thread before other threads start: it swaps ``tempfile.tempdir`` for a
    moment.
    """
    import multiprocessing
    import multiprocessing.util as mp_util

    folder = multiprocessing.current_process()._config.get("tempdir")
    if folder is None:
        temp = tempfile.gettempdir()
        if socket_path_fits(temp):
            return None
        base = next((b for b in bases if os.path.isdir(b) and os.access(b, os.W_OK | os.X_OK) and socket_path_fits(b)),
                    None)
        if base is None:
            raise UserError(_too_long(temp, bases))
        saved = tempfile.tempdir
        tempfile.tempdir = base  # only for multiprocessing's own folder, made and cached just below
        try:
            folder = mp_util.get_temp_dir()
        finally:
            tempfile.tempdir = saved
        log.warning(
            "the temp dir %s is %d characters, too long for the sockets loader workers pass batches "
            "through (Linux allows %d bytes in a socket's path); they go to %s instead (other temp "
            "files stay in the temp dir)", temp, len(temp), MAX_SOCKET_PATH, folder,
        )
        return folder
    if not socket_path_fits(folder, in_pymp=False):  # made by multiprocessing itself, before this call
        raise UserError(_too_long(os.path.dirname(folder), bases))
    return None


def _too_long(folder: str, bases: Sequence[str]) -> str:
    room = MAX_SOCKET_PATH - len(os.sep + _PYMP + os.sep + _LISTENER)
    return (
        f"the temp dir {folder} ({len(os.fsencode(folder))} bytes) is too long for the sockets that loader "
        f"workers and the forkserver bind (Linux allows {MAX_SOCKET_PATH} bytes in a socket's path), and none "
        f"of {', '.join(bases)} is a writable folder to use instead; set TMPDIR to a folder of at most {room} "
        f"characters, or config.DATA.NUM_DATALOADER_WORKERS=0 with MULTI_PROCESSING_METHOD fork"
    )
