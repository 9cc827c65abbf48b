"""The command line of tools/run_distributed_engines.py: one clear line and exit code 2 for
user errors, before any process starts."""

import logging
import os
import sys
from typing import List, Optional

from ssl_engine.errors import USER_ERROR_EXIT_CODE, UserError

log = logging.getLogger("ssl_engine")


def _split_args(argv: List[str]) -> tuple:
    overrides, node_id, debug, engine = [], 0, False, None
    for a in argv:
        if a in ("--debug", "-d"):
            debug = True
        elif a.startswith("node_id="):
            try:
                node_id = int(a.split("=", 1)[1])
            except ValueError:
                raise UserError(f"node_id={a.split('=', 1)[1]!r} is not an integer") from None
        elif a.startswith("--engine="):
            engine = a.split("=", 1)[1]
        elif a in ("-h", "--help"):
            print(_HELP)
            sys.exit(0)
        else:
            overrides.append(a)
    if engine:
        overrides.append(f"engine_name={engine}")
    return overrides, node_id, debug


_HELP = """usage: run_distributed_engines.py config=<name or file.yaml> [config.KEY=value ...] [+config.NEW=value ...]
                                 [node_id=K] [--engine=train|extract_features] [--debug]"""


def prepare_config(overrides: List[str]):
    """Compose, import user modules, and check names and paths: everything before launching."""
    from ssl_engine.config import compose
    from ssl_engine.config.validate import check_data_paths, check_registered_names
    from ssl_engine.engines.run import load_builtin_parts
    from ssl_engine.logger import setup_logging
    from ssl_engine.user_modules import import_user_modules

    setup_logging(0, None)
    cfg = compose(overrides)
    load_builtin_parts()
    import_user_modules(cfg.USER_MODULES)
    check_registered_names(cfg)
    check_data_paths(cfg)
    return cfg


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("SSL_ENGINE_DEBUG", "") not in ("", "0")
    try:
        overrides, node_id, flag = _split_args(argv)
        debug = debug or flag
        cfg = prepare_config(overrides)
        from ssl_engine.launch import launch

        return launch(cfg, node_id=node_id)
    except UserError as e:
        if debug:
            raise
        msg = " ".join(str(e).split()) if "\n" not in str(e).strip() else str(e).strip()
        print(f"error: {msg}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
