"""Logging: rank 0 to the console and CHECKPOINT.DIR/log.txt; other ranks' warnings and
errors still reach the console, prefixed with their rank."""

import logging
import sys
from pathlib import Path
from typing import Optional

_FORMAT = "%(levelname).1s %(asctime)s %(name)s] %(message)s"


class _LogFile(logging.FileHandler):
    """log.txt. A write that fails (a full disk, the folder gone or read-only) is said once, in a
    warning on the console, and the file is written no more: logging's default printed a
    '--- Logging error ---' traceback for every record after it. The console keeps the log."""

    _failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self._failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self._failed = True
        stream, self.stream = self.stream, None
        try:
            if stream is not None:
                stream.close()  # flushes what it buffers, which fails again: the file is left as it is
        except OSError:
            pass
        logging.getLogger(__name__).warning(
            "cannot write %s: %s; the log goes on on the console only", self.baseFilename, error.strerror or error)


def setup_logging(rank: int = 0, folder: Optional[str] = None, verbose: bool = False) -> None:
    """Configure the root logger of this process (idempotent)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_ssl_engine", False):
            root.removeHandler(h)
            h.close()
    level = logging.DEBUG if verbose else logging.INFO
    prefix = "" if rank == 0 else f"[rank {rank}] "
    fmt = logging.Formatter(prefix + _FORMAT, datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(level if rank == 0 else logging.WARNING)
    console.setFormatter(fmt)
    console._ssl_engine = True  # type: ignore[attr-defined]
    root.addHandler(console)
    if rank == 0 and folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fh = _LogFile(Path(folder) / "log.txt")
        fh.setLevel(level)
        fh.setFormatter(fmt)
        fh._ssl_engine = True  # type: ignore[attr-defined]
        root.addHandler(fh)
    root.setLevel(level)
    for noisy in ("PIL", "matplotlib", "fvcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not verbose:  # torch's own INFO lines (e.g. FakeTensor cache statistics at exit) are for its developers
        logging.getLogger("torch").setLevel(logging.WARNING)
