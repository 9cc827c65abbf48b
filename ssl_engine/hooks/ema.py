"""EMAModelHook (HOOKS.EMA_MODEL): an exponential moving average of the model's weights.

After every UPDATE_EVERY_N_ITERS-th optimizer step the EMA copy moves towards the model::

    ema = d * ema + (1 - d) * weights,   d = DECAY * min(1, k / WARMUP_ITERATIONS)

where k counts the EMA updates made so far (with WARMUP_ITERATIONS = 0, d = DECAY from the
start). So the first update copies the weights and the decay ramps up over the warm-up.
Parameters and floating-point buffers (BatchNorm running statistics) are averaged; integer
buffers are copied. The update is one fused foreach op on the device (no sync); with
EMA_DEVICE cpu the average lives in host memory instead (a copy from the GPU per update).

The EMA weights are hook state: they go into every checkpoint and come back on resume. With
EVAL_TEST_PHASES the EMA model also runs on every test batch and its meters appear in
metrics.json as ``test_ema_<meter>`` (e.g. for HOOKS.BEST_CHECKPOINT.METRIC).
"""

import copy
import logging
from typing import Any, Dict, List, Optional

import torch

from ssl_engine import distributed as du
from ssl_engine.errors import UserError
from ssl_engine.hooks.base import Priority, SSLHook
from ssl_engine.registry import HOOKS

log = logging.getLogger(__name__)


def _single(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x


def _real_rows(batch: Any, n: int) -> Optional[torch.Tensor]:
    """Mask of the batch rows that are real samples (``data_valid > 0``), None if all are or unknown."""
    flags = _single(batch.get("data_valid")) if isinstance(batch, dict) else None
    if not isinstance(flags, torch.Tensor) or flags.ndim != 1 or flags.numel() != n:
        return None
    mask = flags > 0
    return None if bool(mask.all()) else mask


@HOOKS.register("EMAModelHook")
class EMAModelHook(SSLHook):
    """Keeps ``ema_model``, an averaged copy of task.base_model, and optionally its test meters."""

    priority = Priority.NORMAL

    def __init__(self, decay: float = 0.9999, every_n_iters: int = 1, warmup_iters: int = 0,
                 eval_test_phases: bool = False, device: str = "gpu") -> None:
        super().__init__()
        if not 0.0 <= float(decay) <= 1.0:
            raise UserError(f"config.HOOKS.EMA_MODEL.DECAY={decay!r} must be in [0, 1]")
        self.decay = float(decay)
        for key, value, least in (("UPDATE_ITER", every_n_iters, 1), ("WARMUP_ITERATIONS", warmup_iters, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UserError(f"config.HOOKS.EMA_MODEL.{key}={value!r} must be an integer >= {least}")
        self.every_n_iters = int(every_n_iters)
        self.warmup_iters = int(warmup_iters)
        self.eval_test_phases = bool(eval_test_phases)
        if device not in ("gpu", "cpu"):
            raise UserError(f"config.HOOKS.EMA_MODEL.EMA_DEVICE={device!r} must be gpu (the model's device) or cpu")
        self.device_name = device
        self.device = torch.device("cpu")
        self.num_updates = 0
        self.ema_model: Optional[torch.nn.Module] = None
        self.meters: List[Any] = []
        self._pending: Optional[Dict[str, Any]] = None
        self._pending_meters: Optional[List[Any]] = None
        self._ema_float: List[torch.Tensor] = []
        self._model_float: List[torch.Tensor] = []
        self._ema_other: List[torch.Tensor] = []
        self._model_other: List[torch.Tensor] = []

    # -- set up -------------------------------------------------------------------------------

    def on_start(self, task: Any) -> None:
        self.device = torch.device("cpu") if self.device_name == "cpu" else task.device
        self.ema_model = copy.deepcopy(task.base_model).to(self.device).eval()
        for p in self.ema_model.parameters():
            p.requires_grad_(False)
        if self._pending is not None:
            self.ema_model.load_state_dict(self._pending)
            self._pending = None
        ema_state = self.ema_model.state_dict()
        model_state = task.base_model.state_dict()
        self._ema_float, self._model_float, self._ema_other, self._model_other = [], [], [], []
        for name, t in ema_state.items():
            if t.is_floating_point():
                self._ema_float.append(t)
                self._model_float.append(model_state[name])
            else:
                self._ema_other.append(t)
                self._model_other.append(model_state[name])
        if du.is_primary():
            log.info("EMA of %d weight tensors, decay %g, every %d iterations, warm-up %d updates%s",
                     len(self._ema_float), self.decay, self.every_n_iters, self.warmup_iters,
                     ", with test-phase meters" if self.eval_test_phases else "")

    # -- the average ----------------------------------------------------------------------------

    def current_decay(self) -> float:
        """The decay of the next update."""
        if self.warmup_iters > 0:
            return self.decay * min(1.0, self.num_updates / self.warmup_iters)
        return self.decay

    def on_update(self, task: Any) -> None:
        if (task.iteration + 1) % self.every_n_iters != 0:  # task.iteration counts this step only after it
            return
        self.update_now()

    @torch.no_grad()
    def update_now(self) -> None:
        """Move the EMA one step towards the model's current weights."""
        d = self.current_decay()
        model_float = self._model_float
        if self._ema_float and model_float[0].device != self.device:  # EMA_DEVICE cpu for a GPU model
            model_float = [t.to(self.device) for t in model_float]
        if self._ema_float:
            torch._foreach_lerp_(self._ema_float, model_float, 1.0 - d)
        for e, m in zip(self._ema_other, self._model_other):
            e.copy_(m)
        self.num_updates += 1

    # -- the EMA model's test meters --------------------------------------------------------------

    def on_phase_start(self, task: Any) -> None:
        if self.eval_test_phases and not task.train:
            self._share_rank0_buffers(task)
            if not self.meters or len(self.meters) != len(task.meters):
                self.meters = [copy.deepcopy(m) for m in task.meters]
            if task.phase_resumed and self._pending_meters:
                for m, st in zip(self.meters, self._pending_meters):
                    m.set_classy_state(st)
            else:
                for m in self.meters:
                    m.reset()
            self._pending_meters = None

    @torch.no_grad()
    def _share_rank0_buffers(self, task: Any) -> None:
        """Give every rank rank 0's EMA buffers (BatchNorm statistics) before a test phase, when the
        model's own are rank 0's at each forward (DISTRIBUTED.BROADCAST_BUFFERS). Each rank averages
        its own model's buffers, which differ after every train forward (each updates them with its
        own batch), so without this each rank would test the EMA model with other statistics than
        the one a checkpoint holds (rank 0's), and a resumed run (every rank starts from rank 0's)
        would test with other statistics than an uninterrupted one."""
        if self.ema_model is None or du.get_world_size() == 1 or not getattr(task.model, "broadcast_buffers", False):
            return
        du.broadcast_from_rank0(self.ema_model.buffers())

    @torch.no_grad()
    def on_loss_and_meter(self, task: Any) -> None:
        if task.train or not self.eval_test_phases or not self.meters:
            return
        batch = task.last_batch
        inputs = _single(batch["data"])
        if self.device != task.device:
            inputs = [x.to(self.device) for x in inputs] if isinstance(inputs, (list, tuple)) else inputs.to(self.device)
        with task.autocast():
            output = self.ema_model(inputs)
        target = _single(batch["label"])
        if isinstance(target, torch.Tensor):
            target = target.to(self.device)
        out = [o.detach().float() for o in output] if isinstance(output, (list, tuple)) else output.detach().float()
        n = target.shape[0] if isinstance(target, torch.Tensor) and target.ndim >= 1 else -1
        mask = _real_rows(batch, n)
        if mask is not None:
            if not bool(mask.any()):
                return
            mask = mask.to(self.device)
            out = [o[mask] for o in out] if isinstance(out, list) else out[mask]
            target = target[mask]
        for m in self.meters:
            m.update(out, target)

    def phase_metrics(self, task: Any) -> Dict[str, Any]:
        """``ema_<meter>`` values of a test phase (called by the MetricsHook on every rank)."""
        if task.train or not self.eval_test_phases:
            return {}
        out = {}
        for m in self.meters:
            m.sync_state()
            out[f"ema_{m.name}"] = m.value
        return out

    # -- state --------------------------------------------------------------------------------------

    def get_classy_state(self) -> Dict[str, Any]:
        if self.ema_model is not None:
            ema = self.ema_model.state_dict()
        else:
            ema = self._pending or {}
        state: Dict[str, Any] = {"num_updates": int(self.num_updates), "decay": self.decay, "ema_model": ema}
        if self.meters:
            state["meters"] = [m.get_classy_state() for m in self.meters]
        return state

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        self.num_updates = int(state["num_updates"])
        if self.ema_model is not None:
            self.ema_model.load_state_dict(state["ema_model"])
        else:
            self._pending = state["ema_model"]
        self._pending_meters = state.get("meters")
