"""Import the user's own modules named in config.USER_MODULES, in every process.

An entry is a dotted module name or a path to a .py file (a relative path is taken from the
current folder); a file is imported under its stem with its folder put on sys.path, so spawned
ranks and loader workers can import it too. A dotted module that is not found on sys.path is
looked for in the current folder too (the tool's own folder, not the one it runs in, is first on
sys.path).
"""

import importlib
import sys
from pathlib import Path
from typing import Iterable

from ssl_engine.errors import UserError, does_not_exist, expand_user


def import_user_modules(entries: Iterable[str]) -> None:
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
        except UserError:
            raise
        except ImportError as e:
            raise UserError(f"config.USER_MODULES: cannot import {entry}: {e}") from None


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
