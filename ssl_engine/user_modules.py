"""Import the user's own modules named in config.USER_MODULES, in every process.

An entry is a dotted module name or a path to a .py file (a relative path is taken from the
current folder); a file is imported under its stem with its folder put on sys.path, so spawned
ranks and loader workers can import it too. A dotted module that is not found on sys.path is
looked for in the current folder too (the tool's own folder, not the one it runs in, is first on
sys.path).
"""

import importlib
import sys
import traceback
from pathlib import Path
from typing import Iterable, Optional

from ssl_engine.errors import UserError, does_not_exist, expand_user


def import_user_modules(entries: Iterable[str]) -> None:
    """Import each entry; a module that cannot be imported (a syntax error, an exception at its
    top level, a name its decorator registers twice) is a UserError naming the entry and the file
    and line where its import failed."""
    for entry in entries:
        entry = str(entry)
        try:
            if entry.endswith(".py") or "/" in entry:
                path = expand_user(entry, "config.USER_MODULES").resolve()
                if not path.is_file():
                    raise UserError(does_not_exist("config.USER_MODULES", entry))
                if str(path.parent) not in sys.path:
                    sys.path.insert(0, str(path.parent))
                importlib.import_module(path.stem)
            else:
                _import_dotted(entry)
        except UserError as e:
            if e.__traceback__ is not None and _user_frame(e) is not None:  # raised by the module's own code
                raise UserError(_import_failure(entry, e)) from e
            raise
        except ImportError as e:
            if _user_frame(e) is not None:  # an import inside the module failed
                raise UserError(_import_failure(entry, e)) from e
            raise UserError(f"config.USER_MODULES: cannot import {entry}: {e}") from None
        except Exception as e:
            raise UserError(_import_failure(entry, e)) from e


def _user_frame(error: BaseException) -> Optional[str]:
    """'file line N' of the innermost frame of ``error``'s traceback outside importlib and this
    package (the user's code that raised), or None when every frame is the engine's own."""
    import ssl_engine

    engine = str(Path(ssl_engine.__file__).parent)
    where = None
    for frame in traceback.extract_tb(error.__traceback__):
        name = frame.filename
        if name.startswith("<frozen") or name.startswith(engine) or "importlib" in name:
            continue
        where = f"{name} line {frame.lineno}"
    return where


def _import_failure(entry: str, error: BaseException) -> str:
    """One line for a module of USER_MODULES whose import raised ``error``."""
    if isinstance(error, SyntaxError):
        where = f"{error.filename} line {error.lineno}" if error.filename else None
        what = f"SyntaxError: {error.msg}"
    else:
        where = _user_frame(error)
        what = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    return f"config.USER_MODULES: cannot import {entry}{f' ({where})' if where else ''}: {what}"


def _import_dotted(entry: str) -> None:
    try:
        importlib.import_module(entry)
    except ModuleNotFoundError as e:
        here = str(Path.cwd())
        if e.name != entry.split(".")[0] or here in sys.path or not (
            Path(here, entry.split(".")[0] + ".py").is_file() or Path(here, entry.split(".")[0]).is_dir()
        ):
            raise
        sys.path.append(here)  # after everything else: a file here never shadows an installed module
        importlib.import_module(entry)
