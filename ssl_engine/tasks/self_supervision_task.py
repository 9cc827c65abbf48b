"""SelfSupervisionTask: a classy_vision ClassyTask holding everything a run needs.

It builds the model, loss, meters, optimizer, datasets and loaders from the config, owns the
loop counters (phase_idx, train_phase_idx, iteration, local_iteration_num) and carries all
resumable state through get_classy_state / set_classy_state. Only the trainer advances the
counters; hooks read them.
"""

import contextlib
import inspect
import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from classy_vision.tasks.classy_task import ClassyTask

from ssl_engine import distributed as du
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import CheckpointError, UserError, first_few
from ssl_engine.hooks.base import EVENTS, order_hooks
from ssl_engine.registry import TASKS
from ssl_engine.resume_state import WRITTEN_BY_VISSL
from ssl_engine.rng import get_rng_state, set_rng_state

log = logging.getLogger(__name__)


def build_task(config: AttrDict) -> "SelfSupervisionTask":
    """The task named by config.TRAINER.TASK_NAME."""
    return TASKS.get(config.TRAINER.TASK_NAME).from_config(config)


def build_phases(config: AttrDict) -> List[Dict[str, bool]]:
    """Train phases from OPTIMIZER.num_epochs, with a test phase after train phases 0, N, 2N, ...
    and after the last one (N = TEST_EVERY_NUM_EPOCH; VISSL's placement, so metrics.json lines up
    with a VISSL run's and a VISSL checkpoint's phase_idx means the same phase here).

    TEST_ONLY gives one test phase. Test phases need DATA.TEST.DATA_SOURCES.
    """
    has_test = bool(config.DATA.TEST.DATA_SOURCES)
    if config.TEST_ONLY:
        if not has_test:
            raise UserError("config.TEST_ONLY is true but config.DATA.TEST.DATA_SOURCES is empty: name the test data")
        return [{"train": False}]
    if not config.DATA.TRAIN.DATA_SOURCES:
        raise UserError("config.DATA.TRAIN.DATA_SOURCES is empty: name the training data (e.g. [digits])")
    test = config.TEST_MODEL and has_test
    if config.TEST_MODEL and not has_test:
        log.info("TEST_MODEL is true but DATA.TEST.DATA_SOURCES is empty: no test phases")
    phases: List[Dict[str, bool]] = []
    n, every = config.OPTIMIZER.num_epochs, config.TEST_EVERY_NUM_EPOCH
    for epoch in range(n):
        phases.append({"train": True})
        if test and (epoch % every == 0 or epoch == n - 1):  # VISSL's rule: after epochs 0, N, 2N, ... and the last
            phases.append({"train": False})
    return phases


def cpu_has_native(dtype_name: str) -> bool:
    """Whether this CPU computes ``dtype_name`` (bfloat16 / float16) natively, as oneDNN sees it;
    True when torch cannot say (no warning is better than a wrong one)."""
    probe = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}.get(dtype_name)
    try:
        return bool(getattr(torch.ops.mkldnn, probe)()) if probe else True
    except (AttributeError, RuntimeError):
        return True


def _load_state_dict_problem(module: torch.nn.Module, part: Any, error: BaseException, prefix: str = "") -> str:
    """Why ``module`` cannot load ``part``, in a few words: the tensors of another shape (file vs
    model), else the names one has and the other lacks; torch's own text (cut) when neither
    says it (e.g. ``part`` is not a mapping of tensors)."""
    if isinstance(part, Mapping):
        mine = module.state_dict()
        sizes = [(k, list(v.shape), list(mine[k].shape)) for k, v in part.items()
                 if k in mine and isinstance(v, torch.Tensor) and v.shape != mine[k].shape]
        if sizes:
            shown = ", ".join(f"{prefix}{k} is {a} in the file, {b} in this model" for k, a, b in sizes[:2])
            return f"{len(sizes)} tensor(s) of another shape: {shown}" + (f" and {len(sizes) - 2} more" if len(sizes) > 2 else "")
        missing = [k for k in mine if k not in part]
        unexpected = [k for k in part if k not in mine]
        if missing or unexpected:
            said = []
            if missing:
                said.append(f"{len(missing)} tensor(s) of this model are not in the file ({first_few([prefix + k for k in missing])})")
            if unexpected:
                said.append(f"{len(unexpected)} in the file are not in this model ({first_few([prefix + str(k) for k in unexpected])})")
            return "; ".join(said)
    return " ".join(str(error).split())[:300]


@TASKS.register("self_supervision_task")
class SelfSupervisionTask(ClassyTask):
    """The state of one run: parts, phases and loop counters."""

    def __init__(self, config: AttrDict) -> None:
        super().__init__()
        self.config = config
        self.phases = build_phases(config)
        self.phase_idx = -1
        self.train_phase_idx = -1
        self.iteration = 0
        self.local_iteration_num = 0
        self.checkpoint_local_iteration: Optional[int] = None  # local_iteration_num as the resumed checkpoint had it
        # (train_phase_idx, train, phase_complete) as the resumed checkpoint had them: what its
        # run had done, whatever phase_idx that is here (see hooks.resume_point)
        self.resume_point: Optional[Tuple[int, bool, bool]] = None
        self.train = True
        self.phase_complete = False
        self._resume_in_phase = False
        self.resumed_from_vissl = False  # set by set_classy_state: the checkpoint was VISSL's
        self._prefetched: Any = None  # ((phase type, epoch, start iter), iterator) from prefetch_next_phase
        self.phase_resumed = False  # True while in a phase re-entered by a mid-phase resume
        self.rank = du.get_rank()
        self.world_size = du.get_world_size()
        self.local_rank = 0
        self.device = torch.device("cpu")
        self.base_model: Optional[torch.nn.Module] = None
        self.model: Optional[torch.nn.Module] = None
        self.loss: Optional[torch.nn.Module] = None
        self.meters: List[Any] = []
        self.optimizer: Any = None
        self.datasets: Dict[str, Any] = {}
        self.batches_per_phase: Dict[str, int] = {}  # full length of a phase, whatever its start batch
        self.dataloaders: Dict[str, Any] = {}
        self.data_iterator: Any = None
        self.grad_scaler: Optional[torch.amp.GradScaler] = None
        self.amp_dtype: Optional[torch.dtype] = None
        from ssl_engine.train_steps import train_step_of

        self.train_step_fn: Callable[["SelfSupervisionTask"], None] = train_step_of(config.TRAINER.TRAIN_STEP_NAME)
        self.checkpoint_folder = str(config.CHECKPOINT.DIR)
        self.last_batch: Any = None
        self.last_model_output: Any = None
        self.last_loss: Optional[torch.Tensor] = None
        self.last_num_samples: Optional[int] = None  # real (not padded) samples of the last batch
        self.pending_loss_check: Any = None  # the device-side finite-loss flag not read yet (train step)
        self._finite_flag_host: Optional[torch.Tensor] = None  # pinned copy of that flag on CUDA (train step)
        self.last_data_time = 0.0
        self.stop_requested = False
        self._hook_calls: Dict[str, List[Callable]] = {ev: [] for ev in EVENTS}
        self._time_hooks = False

    @classmethod
    def from_config(cls, config: AttrDict) -> "SelfSupervisionTask":
        return cls(config)

    # -- building ---------------------------------------------------------------------------

    def set_hooks(self, hooks: List[Any]) -> "SelfSupervisionTask":
        """Install hooks in priority order; only the events a hook overrides are called.

        A hook with ``wants_hook_timing = True`` (the IterationTimer) makes run_hooks time every
        hook call into ``hook_seconds`` (class name -> seconds); otherwise nothing is timed.
        Rank 0 logs the event table.
        """
        self.hooks = order_hooks(hooks)
        self._hook_calls = {ev: [] for ev in EVENTS}
        for h in self.hooks:
            used = h.events_used() if hasattr(h, "events_used") else list(EVENTS[:3]) + ["on_step", "on_phase_end", "on_end"]
            for ev in used:
                if hasattr(h, ev):
                    self._hook_calls[ev].append(getattr(h, ev))
        self._hook_names = {ev: [type(fn.__self__).__name__ for fn in fns] for ev, fns in self._hook_calls.items()}
        self._time_hooks = any(getattr(h, "wants_hook_timing", False) for h in self.hooks)
        self.hook_seconds: Dict[str, float] = {type(h).__name__: 0.0 for h in self.hooks}
        if self.hooks and du.is_primary():
            log.info("hooks by event, in the order they run:\n%s", self.hook_table())
        return self

    def hook_table(self) -> str:
        """Which hooks run at which event, in order, with their priorities (logged at start)."""
        rows = [
            f"  {ev:<18} "
            + ", ".join(f"{type(fn.__self__).__name__}({int(getattr(fn.__self__, 'priority', 50))})" for fn in fns)
            for ev, fns in self._hook_calls.items()
            if fns
        ]
        return "\n".join(rows) or "  (no hooks)"

    def run_hooks(self, event: str) -> None:  # type: ignore[override]
        fns = self._hook_calls[event]
        if not fns:
            return
        if not self._time_hooks:
            for fn in fns:
                fn(self)
            return
        seconds = self.hook_seconds
        clock = time.perf_counter
        t0 = clock()
        for fn, name in zip(fns, self._hook_names[event]):
            fn(self)
            t1 = clock()  # this hook's end is the next one's start: one clock read per hook
            seconds[name] += t1 - t0
            t0 = t1

    def needed_splits(self) -> List[str]:
        splits = []
        if any(p["train"] for p in self.phases):
            splits.append("TRAIN")
        if any(not p["train"] for p in self.phases):
            splits.append("TEST")
        return splits

    def prepare(self, local_rank: int = 0, data: bool = True, **_: Any) -> None:  # type: ignore[override]
        """Build model, loss, meters, datasets, loaders and optimizer on this rank's device.

        ``data=False`` builds the model (with loss, meters and AMP settings) only: no dataset,
        loader or optimizer, for engines that read data their own way (feature extraction).
        """
        from ssl_engine.data import build_dataloader, build_dataset
        from ssl_engine.losses import build_loss
        from ssl_engine.meters import build_meters
        from ssl_engine.models import build_model, convert_sync_batchnorm

        cfg = self.config
        self.local_rank = local_rank
        self.rank, self.world_size = du.get_rank(), du.get_world_size()
        self.device = du.device_for(cfg.MACHINE.DEVICE, local_rank)
        for split in self.needed_splits() if data else []:
            self.datasets[split] = build_dataset(cfg, split)
            self.dataloaders[split] = build_dataloader(
                self.datasets[split], cfg, split, self.rank, self.world_size, cfg.MACHINE.DEVICE
            )
            self.batches_per_phase[split] = len(self.dataloaders[split])
            log.info("%s data: %d samples, %d batches per rank", split.lower(), len(self.datasets[split]), self.batches_per_phase[split])
        model = build_model(cfg.MODEL, cfg.OPTIMIZER)
        if cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN and self.world_size > 1:
            model = convert_sync_batchnorm(model, cfg.MODEL.SYNC_BN_CONFIG, cfg.DISTRIBUTED.NUM_PROC_PER_NODE)
        self.base_model = model.to(self.device)
        self.model = self.base_model
        self.loss = build_loss(cfg.LOSS).to(self.device)
        self.meters = build_meters(cfg.METERS)
        if "TRAIN" in self.dataloaders:
            global_bs = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * self.world_size
            from ssl_engine.optim import build_optimizer

            self.optimizer = build_optimizer(cfg.OPTIMIZER, self.base_model, global_bs, self.iters_per_epoch,
                                             num_nodes=max(1, int(cfg.DISTRIBUTED.NUM_NODES)))
        self._setup_amp()

    def init_weights(self) -> None:
        """MODEL.WEIGHTS_INIT for a new run (never called when resuming)."""
        from ssl_engine.checkpoint import heads_not_set, init_model_from_weights

        trains = any(p["train"] for p in self.phases)
        if not self.config.MODEL.WEIGHTS_INIT.PARAMS_FILE:
            if getattr(self.base_model, "trunk_frozen", False) and trains and du.is_primary():
                # a linear evaluation of a random network: valid as a baseline, a mistake otherwise
                log.warning("the trunk is frozen (config.MODEL.FEATURE_EVAL_SETTINGS) but config.MODEL.WEIGHTS_INIT."
                            "PARAMS_FILE is empty: the run evaluates a randomly initialised trunk; set it to the "
                            "pretrained checkpoint to evaluate that")
            return
        # heads that no phase trains (frozen, or a test-only run) must not be partly random
        untrained = bool(getattr(self.base_model, "heads_frozen", False)) or not trains
        why = heads_not_set(init_model_from_weights(self.base_model, self.config.MODEL, heads_used_untrained=untrained),
                            self.config.MODEL)
        heads = getattr(self.base_model, "heads", None)
        if why is not None and self.config.TEST_ONLY and heads is not None and len(heads):
            log.warning("config.TEST_ONLY tests heads that config.MODEL.WEIGHTS_INIT.PARAMS_FILE did not set (random init)%s", why)

    def wrap_distributed(self) -> None:
        """Wrap the model in DistributedDataParallel when several ranks train it; when several
        ranks only test it (TEST_ONLY, or nothing trainable), give every rank rank 0's weights
        and buffers, as DistributedDataParallel does when it wraps a model. Each rank seeds
        ``SEED_VALUE + rank``, so whatever no checkpoint or weights file set (a random init, heads
        that PARAMS_FILE lacks) would otherwise differ between ranks, and each rank would test
        another model."""
        trainable = any(p.requires_grad for p in self.base_model.parameters())
        if self.world_size > 1 and not (trainable and any(p["train"] for p in self.phases)):
            du.broadcast_from_rank0(list(self.base_model.parameters()) + list(self.base_model.buffers()))
            return
        if self.world_size > 1:
            ddp = torch.nn.parallel.DistributedDataParallel
            # torch >= 2.14 names the forward-time buffer broadcast forward_sync_buffers
            sync_key = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters else "broadcast_buffers"
            self.model = ddp(
                self.base_model,
                device_ids=[self.local_rank] if self.device.type == "cuda" else None,
                bucket_cap_mb=self.config.DATA.DDP_BUCKET_CAP_MB,
                **{sync_key: self.config.DISTRIBUTED.BROADCAST_BUFFERS},
            )

    def _setup_amp(self) -> None:
        amp = self.config.MODEL.AMP_PARAMS
        if not amp.USE_AMP:
            return
        if amp.AMP_TYPE == "apex":
            log.warning("config.MODEL.AMP_PARAMS.AMP_TYPE=apex runs as torch native AMP (apex is not used)")
        name = amp.AMP_DTYPE
        if name == "auto":
            name = "float16" if self.device.type == "cuda" else "bfloat16"
        self.amp_dtype = getattr(torch, name)
        if self.device.type == "cuda" and self.amp_dtype == torch.float16:
            self.grad_scaler = torch.amp.GradScaler("cuda")
        if du.is_primary():  # the numerics change: say so once, with the dtype it chose
            log.info("mixed precision (MODEL.AMP_PARAMS.USE_AMP): forward and loss under torch.autocast to %s on %s%s",
                     name, self.device.type, ", gradients scaled by a GradScaler" if self.grad_scaler else "")
            if self.device.type == "cpu" and not cpu_has_native(name):
                # a GPU yaml run on a laptop: emulated half precision is several times slower than float32
                log.warning("config.MODEL.AMP_PARAMS.USE_AMP=true on a CPU without native %s (%s): autocast emulates it, "
                            "several times slower than float32; "
                            "set config.MODEL.AMP_PARAMS.USE_AMP=false on this machine", name,
                            "AVX512-BF16 / AMX" if name == "bfloat16" else "AVX512-FP16 / AMX-FP16")

    def autocast(self) -> Any:
        """The autocast context of this run (a null context without AMP)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    # -- counters and phases -----------------------------------------------------------------

    @property
    def iters_per_epoch(self) -> int:
        return self.batches_per_phase.get("TRAIN", 0)

    @property
    def phase_iterations(self) -> int:
        """Batches in the current phase (all of them, also after a mid-phase resume)."""
        return self.batches_per_phase.get("TRAIN" if self.train else "TEST", 0)

    @property
    def max_iteration(self) -> int:
        return self.iters_per_epoch * self.config.OPTIMIZER.num_epochs

    @property
    def num_train_phases(self) -> int:
        return sum(p["train"] for p in self.phases)

    @property
    def phase_type(self) -> str:
        return "train" if self.train else "test"

    @property
    def progress_iteration(self) -> int:
        """Train iterations done, counted in this run's batches: the train epochs done times
        ``iters_per_epoch`` plus the position in the current train phase.

        Equals ``iteration`` unless the run resumed with another global batch (more ranks,
        another BATCHSIZE_PER_REPLICA), where ``iteration`` goes on counting the steps actually
        run; the lr schedule and the ETA use this count so that they keep their place in the
        run (epoch 3 of 10 stays 30% of training whatever the batch).
        """
        k = self.train_phase_idx
        if k < 0:
            return 0
        return k * self.iters_per_epoch + self.local_iteration_num if self.train else (k + 1) * self.iters_per_epoch

    @property
    def where(self) -> float:
        """Fraction of training done, in [0, 1] (see :attr:`progress_iteration`)."""
        return min(1.0, self.progress_iteration / max(1, self.max_iteration))

    def done_training(self) -> bool:
        return self.phase_idx + 1 >= len(self.phases) and (self.phase_complete or self.phase_idx < 0)

    def advance_phase(self) -> None:
        """Enter the next phase (or re-enter the interrupted one after a mid-phase resume)."""
        start_iter = 0
        self.phase_resumed = self._resume_in_phase
        if self._resume_in_phase:
            self._resume_in_phase = False
            start_iter = self.local_iteration_num
        else:
            self.phase_idx += 1
            self.train = self.phases[self.phase_idx]["train"]
            if self.train:
                self.train_phase_idx += 1
            self.local_iteration_num = 0
            for m in self.meters:
                m.reset()
        self.phase_complete = False
        self.base_model.train(self.train)
        if self.loss is not None:
            self.loss.train(self.train)  # a loss with state (swav_loss's queue) updates it in train phases only
        if self.train and self.optimizer is not None and self.optimizer.update_interval == "epoch":
            self.optimizer.set_where(self.train_phase_idx / self.config.OPTIMIZER.num_epochs)
        self.recreate_data_iterator(self.phase_type, max(self.train_phase_idx, 0), start_iter)

    def recreate_data_iterator(self, phase_type: str, epoch: int, start_iter: int) -> None:
        """A fresh iterator over the phase's data: order set by (seed, epoch), starting at start_iter.

        Takes the iterator :meth:`prefetch_next_phase` started, when it is still untouched.
        """
        loader = self.dataloaders["TRAIN" if phase_type == "train" else "TEST"]
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == (phase_type, epoch, start_iter):
            it = prefetched[1]
            untouched = getattr(it, "_num_yielded", None) == 0 and getattr(loader, "_iterator", None) is it
            sampler = loader.sampler
            if untouched and (sampler.epoch, sampler.start_iter) == (epoch, start_iter):
                self.data_iterator = it
                return
        loader.sampler.set_epoch(epoch)
        loader.sampler.set_start_iter(start_iter)
        self.data_iterator = iter(loader)

    def prefetch_next_phase(self) -> None:
        """Start the next phase's data iterator now, when the loader has workers.

        Called when a phase's data is exhausted, before its phase-end hooks (meter sync, metrics,
        checkpoint), so the workers load the next phase's first batches while those run instead
        of after. :meth:`recreate_data_iterator` takes it only if nothing used the loader in
        between (e.g. PreciseBN iterating the train data); otherwise it starts a fresh one.
        Nothing of it is in a checkpoint: the loader position is derived from the counters.
        """
        nxt = self.phase_idx + 1
        if nxt >= len(self.phases) or self._resume_in_phase:
            return
        train = bool(self.phases[nxt]["train"])
        split = "TRAIN" if train else "TEST"
        loader = self.dataloaders.get(split)
        if loader is None or loader.num_workers == 0:  # nothing runs ahead without workers
            return
        epoch = max(self.train_phase_idx + (1 if train else 0), 0)
        self.data_iterator = None  # the finished phase's (exhausted; with persistent workers it is reused)
        loader.sampler.set_epoch(epoch)
        loader.sampler.set_start_iter(0)
        self._prefetched = (("train" if train else "test", epoch, 0), iter(loader))

    def close_data_iterators(self) -> None:
        """Stop the loader workers of every iterator this task started: the phase's, the next
        phase's prefetched one and the ones persistent-worker loaders keep.

        Called when a run ends, normally or not. An iterator left to the garbage collector may
        outlive the run when an error's traceback keeps it alive; at interpreter exit,
        multiprocessing would then join its workers, which ignore SIGTERM (they must outlive a
        preemption signal sent to the whole job), and the process would never exit.
        """
        from ssl_engine.data.loader import stop_workers

        prefetched, self._prefetched = self._prefetched, None
        iterators = [self.data_iterator, prefetched[1] if prefetched else None]
        iterators += [getattr(loader, "_iterator", None) for loader in self.dataloaders.values()]
        self.data_iterator = None
        for it in iterators:
            stop_workers(it)
        for loader in self.dataloaders.values():
            if getattr(loader, "_iterator", None) is not None:
                loader._iterator = None  # a persistent iterator whose workers are gone

    @property
    def phase_meters(self) -> List[Any]:
        """The meters the current phase updates: all of them in a test phase, none in a train
        phase with METERS.enable_training_meter false (their values would be an empty count)."""
        if self.train and not self.config.METERS.get("enable_training_meter", True):
            return []
        return list(self.meters)

    def sync_meters(self) -> None:
        for m in self.phase_meters:
            m.sync_state()

    # -- ClassyTask's abstract API, mapped onto the hook events -------------------------------

    def train_step(self) -> None:
        self.train_step_fn(self)

    def eval_step(self) -> None:
        self.train_step_fn(self)

    def on_start(self) -> None:
        self.run_hooks("on_start")

    def on_phase_start(self) -> None:
        self.run_hooks("on_phase_start")

    def on_phase_end(self) -> None:
        self.run_hooks("on_phase_end")

    def on_end(self) -> None:
        self.run_hooks("on_end")

    # -- state --------------------------------------------------------------------------------

    def model_state(self) -> Dict[str, Any]:
        """Weights in VISSL's layout: {'model': {'trunk': ..., 'heads': ...}, 'meta': {}}."""
        m = self.base_model
        trunk = getattr(m, "trunk", None)
        heads = getattr(m, "heads", None)
        if trunk is not None:
            model = {"trunk": trunk.state_dict(), "heads": heads.state_dict() if heads is not None else {}}
        else:
            model = {"trunk": m.state_dict(), "heads": {}}
        return {"model": model, "meta": {}}

    def load_model_state(self, state: Dict[str, Any], trunk_only: bool = False, fix: Optional[str] = None) -> None:
        """Load ``{"model": {"trunk": ..., "heads": ...}}`` (the trunk alone with ``trunk_only``);
        CheckpointError when the weights are missing or do not fit this model (a model config
        changed since they were written), ending with ``fix`` (default: a training run's way out)."""
        m = self.base_model
        try:
            weights = state["model"]
            parts = [(m.trunk, weights["trunk"])] if getattr(m, "trunk", None) is not None else [(m, weights["trunk"])]
            if not trunk_only and getattr(m, "trunk", None) is not None and getattr(m, "heads", None) is not None:
                parts.append((m.heads, weights["heads"]))
        except (KeyError, TypeError):
            raise CheckpointError("it holds no model weights (classy_state_dict.base_model.model.trunk / heads)") from None
        if fix is None and self.config.CHECKPOINT.get("RESUME_FROM"):
            fix = ("the model config differs from the run that wrote it: resume with that run's model config, or start "
                   "a new run from these weights with config.MODEL.WEIGHTS_INIT.PARAMS_FILE")
        from ssl_engine.checkpoint import without_eval_wrapper

        for module, part in parts:
            if module is getattr(m, "trunk", None) and isinstance(part, dict):  # a VISSL linear evaluation's trunk
                part = without_eval_wrapper(part, list(module.state_dict()))
            try:
                module.load_state_dict(part)
            except (RuntimeError, TypeError, AttributeError) as e:
                prefix = "heads." if module is getattr(m, "heads", None) else "trunk." if module is getattr(m, "trunk", None) else ""
                raise CheckpointError(f"its weights do not fit this model ({_load_state_dict_problem(module, part, e, prefix)}); " + (fix or (
                    "the model config differs from the run that wrote it: use a new config.CHECKPOINT.DIR, or set "
                    "config.CHECKPOINT.AUTO_RESUME=false to start this folder over (its files are moved into a "
                    "previous_run.N subfolder)"))) from None

    def _hook_keys(self) -> List[Any]:
        """(key, hook) pairs: the class name, with '#k' for the k-th repeat of a class."""
        seen: Dict[str, int] = {}
        out = []
        for h in self.hooks:
            name = type(h).__name__
            seen[name] = seen.get(name, 0) + 1
            out.append((name if seen[name] == 1 else f"{name}#{seen[name] - 1}", h))
        return out

    def _check_part_states(self, state: Dict[str, Any]) -> None:
        """A hook or meter whose get_classy_state holds an object that a checkpoint cannot load
        without running code (a user's class, a lambda) is a UserError naming it, before any
        checkpoint is written: the checkpoints would be refused by every resume."""
        from ssl_engine.checkpoint import unloadable_value
        from ssl_engine.registry import part_origin

        parts = [(f"hook {key!r}", h, state["hooks"].get(key)) for key, h in self._hook_keys()]
        parts += [(f"meter {type(m).__name__!r}", m, s) for m, s in zip(self.meters, state["meters"])]
        for what, part, part_state in parts:
            found = unloadable_value(part_state)
            if found is not None:
                raise UserError(
                    f"{what} {part_origin(type(part))} get_classy_state() holds a {found[1]} at {found[0]}; a part's "
                    f"state goes into checkpoints, which load without running code: give tensors, numbers, strings, "
                    f"numeric numpy arrays and lists, tuples and dicts of them"
                )

    def _rank_local_state(self) -> Dict[str, Any]:
        """What differs between ranks within a phase and must return to each rank on resume:
        the meters' counts (summed over ranks only at the phase end) and the state of hooks
        that keep per-rank sums (``rank_local_state = True``, e.g. MetricsHook's loss sum), and
        the state of a loss marked the same way (swav_loss's per-rank queue)."""
        local = {
            "meters": [m.get_classy_state() for m in self.meters],
            "hooks": {key: h.get_classy_state() for key, h in self._hook_keys() if _rank_local(h)},
        }
        if self.loss is not None and _rank_local(self.loss):
            local["loss"] = self.loss.state_dict()
        return _to_cpu(local)

    def _set_rank_local_state(self, state: Dict[str, Any], rank_states: List[Dict[str, Any]]) -> Optional[str]:
        """Each rank takes back its own meter and hook sums. With more ranks than the checkpoint's,
        the new ranks start from zero (the phase's totals stay exact); with fewer, the sums of the
        missing ranks are lost for the interrupted phase: the returned note says so (for the one
        warning about the change of world size), else None."""
        note = None
        if len(rank_states) > self.world_size and not state.get("phase_complete", True):
            first, last = self.world_size, len(rank_states) - 1
            note = (f"the meters and loss of the interrupted phase leave out what "
                    f"{f'rank {first}' if first == last else f'ranks {first}..{last}'} had counted")
        if self.rank >= len(rank_states):
            return note
        own = rank_states[self.rank]
        if self.loss is not None and own.get("loss"):
            self.loss.load_state_dict(own["loss"])
        for m, s in zip(self.meters, own.get("meters", [])):
            m.set_classy_state(s)
        for key, h in self._hook_keys():
            if key in own.get("hooks", {}):
                h.set_classy_state(own["hooks"][key])
        return note

    def _phase_data(self, train: bool) -> Dict[str, int]:
        """What a position in a ``train`` (or test) phase means in samples, for checkpoints: the
        phase's global batch (BATCHSIZE_PER_REPLICA x world size), the samples of its data and
        its length in batches. Empty when this task has no such loader."""
        split = "TRAIN" if train else "TEST"
        loader = self.dataloaders.get(split)
        if loader is None or getattr(loader, "batch_size", None) is None:
            return {}
        samples = getattr(loader.sampler, "dataset_len", None)
        return {
            "global_batch": int(loader.batch_size) * self.world_size,
            "num_samples": int(samples if samples is not None else len(loader.dataset)),
            "batches": int(self.batches_per_phase.get(split, len(loader))),
        }

    def _set_vissl_optimizer_and_loss(self, state: Dict[str, Any]) -> None:
        """The optimizer and loss state of a VISSL checkpoint, each where it fits this run's
        (VISSL builds the same regularized / not-regularized param groups in model order); what
        does not fit starts fresh, with one warning that names it."""
        fresh = []
        if self.optimizer is not None:
            groups = len(((state.get("optimizer") or {}).get("optimizer") or {}).get("param_groups") or [])
            if not state.get("optimizer"):
                fresh.append("the optimizer (the checkpoint holds no state of it)")
            elif groups == 4 and len(self.optimizer.optimizer.param_groups) != 4:
                # VISSL's head_optimizer_params layout: trunk and heads, each regularized and not, even
                # when empty; which of its tensors is which cannot be told apart safely (BatchNorm's
                # weight and bias have one shape), so nothing is guessed
                fresh.append("the optimizer (VISSL's 4 param groups, trunk and heads each regularized and not, "
                             "are not mapped onto this run's; its momentum builds up again from zero)")
            else:
                try:
                    self.optimizer.load_state_dict(state["optimizer"])
                except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as e:
                    fresh.append(f"the optimizer ({e})")
        if self.loss is not None and state.get("loss"):
            try:
                self.loss.load_state_dict(state["loss"])
            except (CheckpointError, RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
                fresh.append(f"the loss ({' '.join(str(e).split())[:200]})")
        if fresh and du.is_primary():
            log.warning("VISSL's checkpoint: the state of %s does not fit this run and starts fresh", " and of ".join(fresh))

    def _resume_phase_idx(self, state: Dict[str, Any]) -> Tuple[int, bool]:
        """(index in this config's phases of the checkpoint's phase, whether it is that same phase).

        The checkpoint's ``phase_idx`` counts the phases of the run that wrote it. When this
        config's phase list differs (TEST_MODEL, TEST_EVERY_NUM_EPOCH or num_epochs changed, or a
        checkpoint of a run that placed its test phases by another rule) that index may name
        another phase here, so the position is found by what the phase was: train phase
        ``train_phase_idx``, or the test phase after it. A test phase this config does not have
        is dropped: the run goes on after that train phase (with a warning when it was
        interrupted), so no epoch is skipped or trained twice.
        """
        old, k, train = int(state["phase_idx"]), int(state["train_phase_idx"]), bool(state["train"])
        if old < 0:
            return old, True
        trains = [i for i, p in enumerate(self.phases) if p["train"]]
        if train:
            if k < len(trains):
                return trains[k], True
        else:
            start = trains[k] + 1 if 0 <= k < len(trains) else 0 if k < 0 else len(self.phases)
            end = trains[k + 1] if 0 <= k + 1 < len(trains) else len(self.phases)
            tests = [i for i in range(start, end) if not self.phases[i]["train"]]
            if tests:
                return tests[0], True
        # the phase is not in this config: stand at the end of train phase k (or of the run)
        at = trains[k] if 0 <= k < len(trains) else len(self.phases) - 1 if k >= len(trains) else -1
        if not state["phase_complete"] and at + 1 < len(self.phases) and du.is_primary():  # else nothing is left to run
            log.warning(
                "the checkpoint stopped in a %s phase (after train phase %d) that this config does not have "
                "(TEST_MODEL / TEST_EVERY_NUM_EPOCH / num_epochs differ): going on from the next phase",
                "train" if train else "test", k,
            )
        return at, False

    def _resume_position(self, state: Dict[str, Any]) -> int:
        """The batch of the interrupted phase at which this run goes on (``local_iteration_num``).

        The checkpoint counts its position in its own batches. When this run's global batch (per
        rank batch or number of ranks) or the size of the phase's data differs, the position is
        converted by samples consumed, rounded down so that no sample of the phase is skipped
        (those of a partial batch are seen twice), and one warning says so. Ranks stride through
        one (seed, epoch) permutation, so the first k global batches are the same samples
        whatever the number of ranks. A checkpoint without ``phase_data`` (written before it was
        stored) resumes at its batch count as it always did.
        """
        local = int(state["local_iteration_num"])
        old = state.get("phase_data") or {}
        if state["phase_complete"] or state["phase_idx"] < 0 or not old:
            return local
        new = self._phase_data(bool(state["train"]))
        if not new:
            return local
        batch, samples, batches = int(old["global_batch"]), int(old["num_samples"]), int(old["batches"])
        batch2, samples2, batches2 = new["global_batch"], new["num_samples"], new["batches"]
        if (batch, samples) == (batch2, samples2):
            return local  # the same position in samples
        if local >= batches:
            return batches2  # the phase had used up its data: it ends at once, as it would have
        done = min(local * batch, samples)
        start = batches2 if done >= samples2 else min(done // batch2, batches2)
        if du.is_primary():
            kind = "train" if state["train"] else "test"
            where = (f"the checkpoint stopped {local} batches of {batch} ({done} samples) into "
                     f"{kind} phase {state['phase_idx']}")
            per_rank = new["global_batch"] // self.world_size
            ranks = f" ({self.world_size} ranks x {per_rank})" if self.world_size > 1 else ""
            goes_on = f"it goes on from batch {start} of {batches2}" if start < batches2 else "the phase ends there"
            if samples2 != samples:
                again = ", in the new data's order (some samples of this phase may be skipped or seen twice)"
                msg = (f"{where} ({samples} samples); this run's {kind} data has {samples2} samples"
                       + (f" and its global batch is {batch2}{ranks}" if batch2 != batch else "")
                       + f": {goes_on}" + (again if start < batches2 else ""))
            else:
                twice = done - start * batch2
                msg = (f"{where}; this run's global batch is {batch2}{ranks}: {goes_on}"
                       + (f" (at sample {start * batch2}), so {twice} samples of the phase are seen twice" if twice else ""))
            log.warning("%s", msg)
        return start

    def get_classy_state(self, deep_copy: bool = False) -> Dict[str, Any]:
        """Everything a resumed run needs to continue bit for bit.

        A loss check still pending on the device (see standard_train_step.check_finite_loss) is
        read first: a state whose last loss was NaN/inf is never captured.
        """
        from ssl_engine.train_steps.standard_train_step import confirm_finite_loss

        confirm_finite_loss(self)
        local = self._rank_local_state()
        gathered = du.all_gather_object({"rng": get_rng_state(), "local": local})  # one collective for both
        rng = [g["rng"] for g in gathered]
        state = {
            "train": self.train,
            "phase_idx": self.phase_idx,
            "train_phase_idx": self.train_phase_idx,
            "iteration": self.iteration,
            "num_updates": self.iteration,
            "local_iteration_num": self.local_iteration_num,
            "phase_data": self._phase_data(self.train) if self.phase_idx >= 0 else {},
            "phase_complete": self.phase_complete,
            "num_phases": len(self.phases),
            "base_model": self.model_state(),
            "loss": self.loss.state_dict() if self.loss is not None else {},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else {},
            "meters": local["meters"],
            "hooks": {key: local["hooks"][key] if _rank_local(h) else h.get_classy_state() for key, h in self._hook_keys()},
            "amp": self.grad_scaler.state_dict() if self.grad_scaler is not None else {},
            "rng": rng,
            "world_size": self.world_size,
        }
        if self.world_size > 1:
            state["rank_states"] = [g["local"] for g in gathered]
        self._check_part_states(state)
        if deep_copy:
            import copy

            state = copy.deepcopy(state)
        return state

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        """Restore a state saved by get_classy_state (a mid-phase state re-enters that phase)."""
        if state.get("num_phases", len(self.phases)) != len(self.phases):
            log.warning(
                "the checkpoint was written for %d phases, this config has %d; continuing with this config's phases",
                state["num_phases"], len(self.phases),
            )
        self.load_model_state(state["base_model"])
        self.resumed_from_vissl = state.get("written_by") == WRITTEN_BY_VISSL
        if self.resumed_from_vissl:
            self._set_vissl_optimizer_and_loss(state)
        else:
            if self.loss is not None and state.get("loss"):
                self.loss.load_state_dict(state["loss"])
            if self.optimizer is not None and state.get("optimizer"):
                self.optimizer.load_state_dict(state["optimizer"])
            elif self.optimizer is not None and int(state["iteration"]) > 0 and du.is_primary():
                log.warning("the checkpoint holds no optimizer state: the optimizer goes on from a fresh state "
                            "(momentum and moment estimates start at zero)")
        rank_states = state.get("rank_states")
        lost = None
        if rank_states:
            lost = self._set_rank_local_state(state, rank_states)
        else:
            for m, s in zip(self.meters, state.get("meters", [])):
                m.set_classy_state(s)
        hook_states = state.get("hooks", {})
        for key, h in self._hook_keys():
            if key in hook_states and not (rank_states and _rank_local(h)):
                h.set_classy_state(hook_states[key])
        if self.grad_scaler is not None and state.get("amp"):
            self.grad_scaler.load_state_dict(state["amp"])
        if int(state["phase_idx"]) >= 0:
            self.resume_point = (int(state["train_phase_idx"]), bool(state["train"]), bool(state["phase_complete"]))
        self.phase_idx, in_phase = self._resume_phase_idx(state)
        self.train_phase_idx = state["train_phase_idx"]
        self.iteration = state["iteration"]
        rng = state.get("rng") or []
        old_world = int(state.get("world_size", 1))
        if old_world != self.world_size and du.is_primary():  # one warning for all ranks
            notes = (["RNG states are not restored exactly"] if rng else []) + ([lost] if lost else [])
            if notes:
                log.warning("the checkpoint was written by %d rank%s, this run has %d: %s", old_world,
                            "" if old_world == 1 else "s", self.world_size, ", and ".join(notes))
        # the checkpoint's count: its log lines up to there are kept (see periodic_writer.logged_before)
        self.checkpoint_local_iteration = int(state["local_iteration_num"])
        self.local_iteration_num = self._resume_position(state)
        self.train = state["train"] if in_phase else self.phases[self.phase_idx]["train"] if self.phase_idx >= 0 else True
        self.phase_complete = state["phase_complete"] or not in_phase
        self._resume_in_phase = not self.phase_complete and self.phase_idx >= 0
        if rng:
            set_rng_state(rng[self.rank % len(rng)])


def _rank_local(hook: Any) -> bool:
    return bool(getattr(hook, "rank_local_state", False))


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (states gathered from other ranks are pickled)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
