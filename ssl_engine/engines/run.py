"""The per-process entry point: set up the process, run the named engine, tear down."""

import logging
import os
import time
from typing import Any, Optional

from ssl_engine import distributed as du
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.distributed import RankInfo
from ssl_engine.errors import file_system_error
from ssl_engine.logger import setup_logging
from ssl_engine.registry import ENGINES, load_builtin_parts
from ssl_engine.user_modules import import_user_modules

log = logging.getLogger(__name__)


def run_engine(cfg: AttrDict, info: RankInfo) -> Any:
    """Run ``cfg.engine_name`` as rank ``info.rank`` of ``info.world_size``."""
    from ssl_engine import preemption

    try:
        setup_logging(info.rank, cfg.CHECKPOINT.DIR, cfg.VERBOSE)
    except OSError as e:  # e.g. a folder named log.txt
        raise (file_system_error(e) or e) from None
    if cfg.VERBOSE and info.rank == 0:
        from ssl_engine.config import to_yaml

        log.info("%s engine, config:\n%s", cfg.engine_name, to_yaml(cfg).rstrip())
    load_builtin_parts()
    import_user_modules(cfg.USER_MODULES)
    preemption.install()
    du.init_process_group(info, cfg.DISTRIBUTED.TIMEOUT_MINUTES)
    try:
        du.seed_everything(cfg.SEED_VALUE + info.rank)
        return ENGINES.get(cfg.engine_name)(cfg, info)
    except BaseException as e:
        # when this rank failed: taken before the process group closes below, which makes the
        # other ranks fail too, so the launcher can tell which rank failed first
        global failed_at
        failed_at = time.time()
        from ssl_engine.data.loader import unsent_batch_error

        # a loader worker's own account of why it ended, or a file the user's setup made unusable
        user_error = unsent_batch_error(e) or file_system_error(e)
        if user_error is not None:
            raise user_error from None
        raise
    finally:
        du.destroy_process_group()
        from ssl_engine.data.loader import remove_unsent_batch_files

        remove_unsent_batch_files([os.getpid()])  # its workers' lines: read above, or never (it stopped first)


failed_at: Optional[float] = None  # see run_engine
