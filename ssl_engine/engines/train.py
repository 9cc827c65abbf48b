"""The train engine: resume or start, then run the phases with the default hooks."""

import logging
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ssl_engine import distributed as du
from ssl_engine.checkpoint import (
    POINTER,
    atomic_write_text,
    final_checkpoint,
    final_phase,
    is_engine_checkpoint,
    list_checkpoints,
    load_checkpoint,
    newest_good_checkpoint,
    resume_from_file,
)
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.compose import to_yaml
from ssl_engine.distributed import RankInfo
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.hooks import default_hooks
from ssl_engine.lock import FolderLock
from ssl_engine.registry import ENGINES
from ssl_engine.trainer import SelfSupervisionTrainer

log = logging.getLogger(__name__)


def clear_finished_run(folder: Path) -> None:
    """CHECKPOINT.OVERWRITE_EXISTING: remove a finished run's checkpoints and logs (rank 0)."""
    for p in list_checkpoints(folder):
        p.unlink()
    for name in (POINTER, "metrics.json", "stdout.json"):
        p = folder / name
        if p.is_symlink() or p.exists():
            p.unlink()
    tb = folder / "tb_logs"
    if tb.is_dir():
        shutil.rmtree(tb)


def resume_checkpoint(cfg: AttrDict) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The checkpoint this run continues from, loaded: RESUME_FROM, else the folder's newest good one."""
    if cfg.CHECKPOINT.RESUME_FROM:
        path = resume_from_file(cfg.CHECKPOINT.RESUME_FROM)
        data = load_checkpoint(path)
        if not is_engine_checkpoint(data):
            raise CheckpointError(
                f"config.CHECKPOINT.RESUME_FROM: {path} is not an ssl_engine checkpoint (no phase_idx / "
                f"classy_state_dict); to start from its weights use config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
            )
        return str(path), data
    if not cfg.CHECKPOINT.AUTO_RESUME:
        return None
    found = newest_good_checkpoint(Path(cfg.CHECKPOINT.DIR))
    return (str(found[0]), found[1]) if found else None


class _Trainer(SelfSupervisionTrainer):
    """Writes train_config.yaml once setup has succeeded: a config that fails to build or to
    resume never replaces the one that goes with the folder's checkpoints."""

    def setup(self) -> Any:
        task = super().setup()
        if self.checkpoint_path and task.done_training():
            # a finished run is found by its final checkpoint before this; here the checkpoint
            # came from elsewhere (RESUME_FROM, a pointer) or the config now has fewer phases
            raise UserError(
                f"{self.checkpoint_path} was written after phase {task.phase_idx + 1} of its run and this config has {len(task.phases)} "
                f"phases: nothing is left to run; raise config.OPTIMIZER.num_epochs to train on from it, or start a "
                f"new run from its weights with config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
            )
        if du.is_primary():
            atomic_write_text(Path(self.checkpoint_folder) / "train_config.yaml", to_yaml(self.cfg))
        return task


def _take_folder_lock(lock: Optional[FolderLock]) -> bool:
    """Rank 0 takes the folder lock; every rank learns whether it got it (ranks > 0 then stop
    quietly and rank 0 raises the reason)."""
    error: Optional[UserError] = None
    if lock is not None:
        try:
            lock.acquire()
        except UserError as e:
            error = e
    ok = du.all_gather_object(error is None)[0] if du.get_world_size() > 1 else error is None
    if error is not None:
        raise error
    return ok


@ENGINES.register("train")
def train_engine(cfg: AttrDict, info: RankInfo) -> Any:
    folder = Path(cfg.CHECKPOINT.DIR)
    lock = FolderLock(folder) if du.is_primary() else None
    if not _take_folder_lock(lock):
        return None
    try:
        return _train(cfg, info, folder)
    finally:
        if lock is not None:
            lock.release()


def _refuse_training_checkpoint_for_test_only(cfg: AttrDict, path: str, train_phase_idx: int) -> None:
    """TEST_ONLY builds one test phase: it cannot continue a training's checkpoint (whose position
    is in its train phases), and writing its own checkpoints there would end that training."""
    if cfg.TEST_ONLY and train_phase_idx >= 0:
        where = "config.CHECKPOINT.RESUME_FROM" if cfg.CHECKPOINT.RESUME_FROM else f"config.CHECKPOINT.DIR {cfg.CHECKPOINT.DIR}"
        raise UserError(
            f"config.TEST_ONLY=true cannot continue a training run: {where} holds its checkpoint {path}; to test "
            f"its weights, run in a new folder with config.CHECKPOINT.DIR=<new folder> "
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={path}"
        )


def _train(cfg: AttrDict, info: RankInfo, folder: Path) -> Any:
    finished = final_checkpoint(folder)
    if finished is not None and not cfg.CHECKPOINT.RESUME_FROM and not cfg.CHECKPOINT.OVERWRITE_EXISTING:
        _refuse_training_checkpoint_for_test_only(cfg, str(finished), final_phase(finished))
    if finished is not None and not cfg.CHECKPOINT.RESUME_FROM:
        if not cfg.CHECKPOINT.OVERWRITE_EXISTING:
            log.info(
                "the run in %s has finished (%s exists); nothing to do. "
                "Set config.CHECKPOINT.OVERWRITE_EXISTING=true to run it again.", folder, finished.name,
            )
            return None
        if du.is_primary():
            log.warning("CHECKPOINT.OVERWRITE_EXISTING: removing the finished run's checkpoints in %s", folder)
            clear_finished_run(folder)
        du.barrier()
    resume = resume_checkpoint(cfg)
    if resume is not None:
        _refuse_training_checkpoint_for_test_only(cfg, resume[0], int(resume[1].get("train_phase_idx", -1)))
    if du.is_primary():
        folder.mkdir(parents=True, exist_ok=True)
    trainer = _Trainer(
        cfg, info.init_method, resume[0] if resume else None, str(folder), default_hooks(cfg),
        local_rank=info.local_rank, checkpoint=resume[1] if resume else None,
    )
    return trainer.train()
