"""The extract_features engine: write features of chosen layers for each split."""

import logging
from pathlib import Path
from typing import Any

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.distributed import RankInfo
from ssl_engine.registry import ENGINES
from ssl_engine.trainer import SelfSupervisionTrainer

log = logging.getLogger(__name__)


@ENGINES.register("extract_features")
def extract_features_engine(cfg: AttrDict, info: RankInfo) -> Any:
    from ssl_engine.engines.train import resume_checkpoint

    checkpoint_path = None if cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE else resume_checkpoint(cfg)
    trainer = SelfSupervisionTrainer(cfg, info.init_method, checkpoint_path, str(Path(cfg.CHECKPOINT.DIR)), [],
                                     local_rank=info.local_rank)
    return trainer.extract()
