"""The train engine: resume or start, then run the phases with the default hooks."""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ssl_engine import distributed as du
from ssl_engine.checkpoint import (
    atomic_write_text,
    check_intact,
    checkpoint_problem,
    final_checkpoint,
    final_phase,
    is_engine_checkpoint,
    load_checkpoint,
    newest_good_checkpoint,
    repoint_to_final,
    resume_from_file,
    finish_set_aside,
    set_aside_previous_run,
)
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.compose import to_yaml
from ssl_engine.distributed import RankInfo
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.hooks import default_hooks
from ssl_engine.lock import held_by_rank0
from ssl_engine.registry import ENGINES
from ssl_engine.resume_state import state_problem
from ssl_engine.trainer import SelfSupervisionTrainer

log = logging.getLogger(__name__)


def resume_checkpoint(cfg: AttrDict, skip: Sequence[Path] = ()) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The checkpoint this run continues from, loaded: RESUME_FROM, else the folder's newest good
    one (``skip``: files already found unusable, not read again)."""
    if cfg.CHECKPOINT.RESUME_FROM:
        path = resume_from_file(cfg.CHECKPOINT.RESUME_FROM)
        try:
            data = load_checkpoint(path)
        except CheckpointError as e:  # say which setting names the file
            raise CheckpointError(f"config.CHECKPOINT.RESUME_FROM: {e}") from None
        check_intact(path, "config.CHECKPOINT.RESUME_FROM")
        if not is_engine_checkpoint(data):
            raise CheckpointError(
                f"config.CHECKPOINT.RESUME_FROM: {path} is not an ssl_engine checkpoint (no phase_idx / "
                f"classy_state_dict); to start from its weights use config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
            )
        problem = state_problem(data)
        if problem:
            raise CheckpointError(f"config.CHECKPOINT.RESUME_FROM: {path}: {problem}; to start from its weights use "
                                  f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE")
        return str(path), data
    if not cfg.CHECKPOINT.AUTO_RESUME:
        return None
    found = newest_good_checkpoint(Path(cfg.CHECKPOINT.DIR), skip=skip)
    return (str(found[0]), found[1]) if found else None


def load_chosen_checkpoint(path: str) -> Dict[str, Any]:
    """The checkpoint rank 0 chose, read by another rank: one that cannot read it (a checkpoint
    folder that is not shared between the nodes, say) stops the run naming the file."""
    try:
        return load_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(
            f"cannot read the checkpoint rank 0 resumes from ({e}); every rank reads it: "
            f"config.CHECKPOINT.DIR must be a folder that all nodes share"
        ) from None


class _NothingLeft(Exception):
    """The folder's own newest checkpoint leaves no phase to run (a finished run resumed under
    CHECKPOINT.OVERWRITE_EXISTING): the run ends with the finished message, exit 0."""


def _finished_message(folder: Path, final_name: str, cfg: AttrDict) -> str:
    """The line for a finished run in ``folder`` that this command leaves as it is."""
    if cfg.CHECKPOINT.OVERWRITE_EXISTING:  # it resumed from its newest checkpoint, which ends the run
        how = ("With config.CHECKPOINT.OVERWRITE_EXISTING=true it resumed from its newest checkpoint, as in VISSL: raise "
               "config.OPTIMIZER.num_epochs to train on, or set config.CHECKPOINT.AUTO_RESUME=false to train again from "
               "scratch (the run's files are then moved into a previous_run.N subfolder)")
    else:
        how = ("Set config.CHECKPOINT.OVERWRITE_EXISTING=true to run it again: with config.OPTIMIZER.num_epochs raised it "
               "trains on, with config.CHECKPOINT.AUTO_RESUME=false it starts over")
    return f"the run in {folder} has finished ({final_name} exists); nothing to do. {how}"


class _Trainer(SelfSupervisionTrainer):
    """Writes train_config.yaml once setup has succeeded: a config that fails to build or to
    resume never replaces the one that goes with the folder's checkpoints. A run that starts
    from scratch first moves an earlier run's checkpoints out of its way (rank 0)."""

    refuses_finished_folder = False  # _train has judged the folder; a start from scratch moves its files aside

    def setup(self) -> Any:
        task = super().setup()
        if self.checkpoint_path and task.done_training():
            if not self.cfg.CHECKPOINT.RESUME_FROM and Path(self.checkpoint_path).name.startswith("model_final_"):
                raise _NothingLeft(Path(self.checkpoint_path).name)
            # a finished run is found by its final checkpoint before this; here the checkpoint
            # came from elsewhere (RESUME_FROM, a pointer) or the config now has fewer phases
            epochs = int(task.train_phase_idx) + 1
            point = getattr(task, "resume_point", None)  # (train_phase_idx, train, phase_complete) of the file
            if point is not None and point[1] and not point[2]:  # written inside a training epoch
                where, enough = f"during training epoch {point[0] + 1}", f"to {point[0] + 1} or more"
            else:
                where, enough = f"after {epochs} training epoch{'s' if epochs != 1 else ''}", f"above {epochs}"
            raise UserError(
                f"{self.checkpoint_path} was written {where} of its run, and this config trains "
                f"config.OPTIMIZER.num_epochs={self.cfg.OPTIMIZER.num_epochs}: nothing is left to run; raise "
                f"config.OPTIMIZER.num_epochs {enough} to train on from it, or start a new run from its weights with "
                f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
            )
        if du.is_primary():
            if not self.checkpoint_path:
                # after the weights are loaded (PARAMS_FILE may be one of those files) and before
                # any hook opens metrics.json, stdout.json or tb_logs
                set_aside_previous_run(Path(self.checkpoint_folder))
            atomic_write_text(Path(self.checkpoint_folder) / "train_config.yaml", to_yaml(self.cfg))
        return task


@ENGINES.register("train")
def train_engine(cfg: AttrDict, info: RankInfo, hooks: Optional[List[Any]] = None) -> Any:
    folder = Path(cfg.CHECKPOINT.DIR)
    with held_by_rank0(folder) as held:
        return _train(cfg, info, folder, hooks) if held else None


def run_training(cfg: AttrDict, hooks: Optional[List[Any]] = None) -> Any:
    """Train ``cfg`` in this one process (a notebook, a script) as the tool's train engine does:
    the folder's lock; a finished run left as it is (the tool's "has finished" line is logged and
    None returned); auto-resume from the folder's newest good checkpoint; train_config.yaml; an
    earlier run's files moved aside when it starts over. ``hooks``: ``default_hooks(cfg)`` when
    None. Returns the task. Seeds this process with ``SEED_VALUE``, as the tool seeds rank 0."""
    from ssl_engine.registry import load_builtin_parts
    from ssl_engine.user_modules import import_user_modules

    load_builtin_parts()
    import_user_modules(cfg.USER_MODULES)
    du.seed_everything(cfg.SEED_VALUE)
    return train_engine(cfg, RankInfo(), hooks)


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


def _train(cfg: AttrDict, info: RankInfo, folder: Path, hooks: Optional[List[Any]] = None) -> Any:
    # VISSL's rules: a folder with a final checkpoint holds a finished run, and is left alone
    # unless CHECKPOINT.OVERWRITE_EXISTING; that key only lifts this check. The run then resumes
    # from the folder's newest checkpoint under AUTO_RESUME, or starts from scratch without it
    # (the earlier run's files moved aside, see _Trainer). Nothing is ever deleted.
    # Rank 0 alone reads the final checkpoint (a whole file, maybe GBs) and every rank acts on
    # its answer: ranks that judged the file apart could part ways, one training, one not. An
    # error of rank 0 here is raised there after the exchange, and the other ranks stop quietly
    # (as held_by_rank0's do) instead of waiting for an answer that never comes.
    finished, problem, error = None, None, None
    if du.is_primary():
        try:
            finish_set_aside(folder)  # a run killed while moving an earlier run's files aside left part of them
            finished = final_checkpoint(folder)
            if finished is not None and not cfg.CHECKPOINT.RESUME_FROM and not cfg.CHECKPOINT.OVERWRITE_EXISTING:
                problem, _ = checkpoint_problem(finished)
        except Exception as e:
            error = e
    finished, problem, failed = du.all_gather_object((finished, problem, error is not None))[0]
    if error is not None:
        raise error
    if failed:
        return None
    if finished is not None and not cfg.CHECKPOINT.RESUME_FROM and not cfg.CHECKPOINT.OVERWRITE_EXISTING:
        if problem:  # damaged after the run (a copy, a disk): the run goes on from its newest good checkpoint
            how = ("it goes on from its newest good checkpoint and writes {} again" if cfg.CHECKPOINT.AUTO_RESUME else
                   "with config.CHECKPOINT.AUTO_RESUME=false it trains again from scratch (the earlier run's files are "
                   "moved into a previous_run.N subfolder)").format(finished.name)
            log.warning("%s cannot be used (%s): the run is not finished after all; %s", finished.name, problem, how)
        else:
            _refuse_training_checkpoint_for_test_only(cfg, str(finished), final_phase(finished))
            if du.is_primary():
                repoint_to_final(folder, finished)
            log.info(_finished_message(folder, finished.name, cfg))
            return None
    # rank 0 alone chooses the checkpoint to resume from, and every rank reads that file: ranks
    # that chose apart (a file one of them could not read) would train from different states
    resume, error = None, None
    if du.is_primary():
        try:
            resume = resume_checkpoint(cfg, skip=[finished] if finished is not None and problem else [])
        except Exception as e:
            error = e
    chosen, failed = du.all_gather_object((resume[0] if resume else None, error is not None))[0]
    if error is not None:
        raise error
    if failed:
        return None
    if chosen is not None:  # every rank says whether it read the file: rank 0 stops too where one could not
        unread = None
        if resume is None:
            try:
                resume = (chosen, load_chosen_checkpoint(chosen))
            except CheckpointError as e:
                unread = e
        unread_anywhere = any(du.all_gather_object(unread is not None))
        if unread is not None:
            raise unread
        if unread_anywhere:
            return None
    if resume is not None:
        _refuse_training_checkpoint_for_test_only(cfg, resume[0], int(resume[1].get("train_phase_idx", -1)))
    if du.is_primary():
        folder.mkdir(parents=True, exist_ok=True)
    trainer = _Trainer(
        cfg, info.init_method, resume[0] if resume else None, str(folder), default_hooks(cfg) if hooks is None else hooks,
        local_rank=info.local_rank, checkpoint=resume[1] if resume else None,
    )
    try:
        return trainer.train()
    except _NothingLeft as e:
        log.info(_finished_message(folder, str(e), cfg))
        return None
