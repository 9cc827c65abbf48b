"""SelfSupervisionTrainer: the phase loop. Everything optional happens in hooks."""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from ssl_engine import distributed as du
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.tasks import build_task

log = logging.getLogger(__name__)


def model_only(task: Any) -> Dict[str, Any]:
    """``prepare``'s keyword for a model-only task, where the task's ``prepare`` takes it: a user
    task (TRAINER.TASK_NAME) that overrides ``prepare(self, local_rank=0)`` builds as it always
    did (its loaders and optimizer too)."""
    import inspect

    try:
        params = inspect.signature(task.prepare).parameters
    except (TypeError, ValueError):
        return {}
    takes = "data" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {"data": False} if takes else {}


class SelfSupervisionTrainer:
    """Builds the task, resumes it if a checkpoint is given, and steps through its phases.

    It does not look for a checkpoint in its folder (``ssl_engine.engines.train.run_training``
    does, as the tool does); it refuses to train from scratch over a finished run there."""

    #: train() without a checkpoint refuses a folder that holds a final checkpoint: starting over
    #: would overwrite that run's final checkpoint and metrics without a word
    refuses_finished_folder = True

    def __init__(
        self,
        cfg: AttrDict,
        dist_run_id: str = "",
        checkpoint_path: Optional[str] = None,
        checkpoint_folder: Optional[str] = None,
        hooks: Optional[List[Any]] = None,
        local_rank: int = 0,
        checkpoint: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.cfg = cfg
        self.dist_run_id = dist_run_id
        self.checkpoint_path = checkpoint_path
        self.checkpoint_folder = checkpoint_folder or cfg.CHECKPOINT.DIR
        self.hooks = hooks or []
        self.local_rank = local_rank
        self._checkpoint = checkpoint  # the loaded checkpoint_path, when the caller has read it already
        self.task = build_task(cfg)

    def setup(self) -> Any:
        """Build the task's parts, install hooks, then resume or initialise weights."""
        from ssl_engine.checkpoint import load_checkpoint, remove_stale_temp_files
        from ssl_engine.errors import CheckpointError
        from ssl_engine.resume_state import from_vissl, written_by_vissl

        if du.is_primary():
            Path(self.checkpoint_folder).mkdir(parents=True, exist_ok=True)  # the tool's logging made it; Python use may not
            remove_stale_temp_files(self.checkpoint_folder)
        task = self.task
        task.checkpoint_folder = self.checkpoint_folder
        task.prepare(local_rank=self.local_rank)
        task.set_hooks(self.hooks)
        if self.checkpoint_path:
            data = self._checkpoint if self._checkpoint is not None else load_checkpoint(self.checkpoint_path)
            self._checkpoint = None
            state = data["classy_state_dict"]
            if written_by_vissl(data):
                state = from_vissl(data, getattr(task, "iters_per_epoch", None), str(self.checkpoint_path))
            try:
                task.set_classy_state(state)
            except CheckpointError as e:
                raise CheckpointError(f"cannot resume from {self.checkpoint_path}: {e}") from None
            except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
                # a part of the state (loss, meters, hooks, RNG) that is not what this run saves:
                # the file was changed since it was written, or another program wrote it
                raise CheckpointError(
                    f"cannot resume from {self.checkpoint_path}: its training state does not fit this run "
                    f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); it was changed since it was written "
                    f"or comes from another program; to start from its weights use config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
                ) from None
            log.info("resumed from %s at phase %d, iteration %d", self.checkpoint_path, task.phase_idx, task.iteration)
        else:
            task.init_weights()
        task.wrap_distributed()
        return task

    def train(self) -> Any:
        """Run every remaining phase; hooks log, write metrics and checkpoint."""
        if self.refuses_finished_folder and not self.checkpoint_path and du.is_primary():
            self._refuse_finished_folder()
        task = self.setup()
        try:
            task.on_start()
            while not task.done_training():
                task.advance_phase()
                task.on_phase_start()
                while True:
                    try:
                        task.train_step_fn(task)
                    except StopIteration:
                        break
                    task.run_hooks("on_step")
                task.prefetch_next_phase()
                task.sync_meters()
                du.barrier()
                task.phase_complete = True
                task.on_phase_end()
            task.on_end()
        except BaseException:
            task.run_hooks("on_exception")
            raise
        finally:
            task.close_data_iterators()
        return task

    def _refuse_finished_folder(self) -> None:
        from ssl_engine.checkpoint import final_checkpoint
        from ssl_engine.errors import UserError

        final = final_checkpoint(Path(self.checkpoint_folder))
        if final is not None:
            raise UserError(
                f"{self.checkpoint_folder} holds a finished run ({final.name}); SelfSupervisionTrainer.train() without a "
                f"checkpoint_path trains from scratch and would overwrite it: call "
                f"ssl_engine.engines.train.run_training(cfg) to resume or leave it as the tool does, or use another "
                f"config.CHECKPOINT.DIR"
            )

    def extract(self) -> Any:
        """Write features of the configured layers for each split (see ssl_engine.features).

        Only the model weights are loaded (self.checkpoint_path, or MODEL.WEIGHTS_INIT), never
        the training state; the model runs in eval mode without gradients.
        """
        import torch

        from ssl_engine.engines.extract_features import (
            build_extraction_datasets, extract_split, extraction_splits, load_weights, log_summary, output_dir,
            weights_identity,
        )

        task = self.task
        task.checkpoint_folder = self.checkpoint_folder
        with torch.random.fork_rng(devices=[]):  # the same random init on every rank
            torch.manual_seed(self.cfg.SEED_VALUE)
            task.prepare(local_rank=self.local_rank, **model_only(task))  # extraction builds its own loaders
        source = load_weights(task, self.checkpoint_path)
        task.extracted_weights = weights_identity(source, self.cfg.SEED_VALUE)  # in each split's status file
        task.base_model.eval()
        folder = output_dir(self.cfg)
        if du.is_primary():
            from ssl_engine.checkpoint import remove_stale_temp_files

            remove_stale_temp_files(folder)  # shard files a killed extraction left half written
        splits = extraction_splits(self.cfg)
        try:
            build_extraction_datasets(task, splits)
            summaries = [extract_split(task, split, folder) for split in splits]
        finally:
            task.close_data_iterators()
        log_summary(summaries, source)
        return summaries
