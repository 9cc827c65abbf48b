"""Import the user's own modules named in config.USER_MODULES, in every process.

An entry is a dotted module name or a path to a .py file; a file is imported under its
stem with its folder put on sys.path, so spawned ranks and loader workers can import it too.
"""

import importlib
import sys
from pathlib import Path
from typing import Iterable

from ssl_engine.errors import UserError, does_not_exist


def import_user_modules(entries: Iterable[str]) -> None:
    for entry in entries:
        entry = str(entry)
        try:
            if entry.endswith(".py") or "/" in entry:
                path = Path(entry).expanduser().resolve()
                if not path.is_file():
                    raise UserError(does_not_exist("config.USER_MODULES", entry))
                if str(path.parent) not in sys.path:
                    sys.path.insert(0, str(path.parent))
                importlib.import_module(path.stem)
            else:
                importlib.import_module(entry)
        except UserError:
            raise
        except ImportError as e:
            raise UserError(f"config.USER_MODULES: cannot import {entry}: {e}") from None
