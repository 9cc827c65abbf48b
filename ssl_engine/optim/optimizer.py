"""The optimizer a task trains with: a torch optimizer plus its lr schedule and LARC.

``build_optimizer`` reads ``config.OPTIMIZER`` (VISSL's keys), splits the model's
parameters into regularized and non-regularized groups, builds the torch optimizer
through the OPTIMIZERS registry and the lr schedule through :mod:`.schedulers`.

The trainer owns training progress: it calls ``set_where(where)`` before a step (for
``update_interval == 'step'``) or at the start of a train phase (for 'epoch'), then
``step()``. Everything needed to resume exactly is in ``state_dict()``, made of tensors
and plain containers so that ``torch.load(weights_only=True)`` reads it.
"""

import logging
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.optim.larc import apply_larc_, parse_larc_config
from ssl_engine.optim.schedulers import build_lr_scheduler
from ssl_engine.registry import OPTIMIZERS

logger = logging.getLogger(__name__)

OPT_KEY = "config.OPTIMIZER"

# Modules whose parameters count as normalization parameters for ``regularize_bn``.
NORM_TYPES = (
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm*
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
)
if hasattr(nn, "RMSNorm"):
    NORM_TYPES = NORM_TYPES + (nn.RMSNorm,)

OptimizerBuilder = Callable[[List[Dict[str, Any]], Mapping[str, Any]], torch.optim.Optimizer]


# Registered builders take (param_groups, config.OPTIMIZER) and return a torch optimizer.
# Group dicts already hold weight_decay; lr is set by the schedule before any step.
@OPTIMIZERS.register("sgd")
def _sgd(param_groups: List[Dict[str, Any]], cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    momentum = float(cfg.get("momentum", 0.9))
    if not 0.0 <= momentum < 1.0:
        raise UserError(f"{OPT_KEY}.momentum={momentum!r} must be in [0, 1)")
    nesterov = bool(cfg.get("nesterov", False))
    if nesterov and momentum == 0:
        raise UserError(f"{OPT_KEY}.nesterov=True needs {OPT_KEY}.momentum > 0")
    return torch.optim.SGD(param_groups, lr=0.0, momentum=momentum, nesterov=nesterov)


def _betas(cfg: Mapping[str, Any]) -> tuple:
    betas = cfg.get("betas", [0.9, 0.999])
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise UserError(f"{OPT_KEY}.betas={betas!r} must be a list of two numbers, e.g. [0.9, 0.999]")
    return (float(betas[0]), float(betas[1]))


@OPTIMIZERS.register("adam")
def _adam(param_groups: List[Dict[str, Any]], cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adam(param_groups, lr=0.0, betas=_betas(cfg), eps=float(cfg.get("eps", 1e-8)),
                            amsgrad=bool(cfg.get("amsgrad", False)))


@OPTIMIZERS.register("adamw")
def _adamw(param_groups: List[Dict[str, Any]], cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups, lr=0.0, betas=_betas(cfg), eps=float(cfg.get("eps", 1e-8)),
                             amsgrad=bool(cfg.get("amsgrad", False)))


@OPTIMIZERS.register("rmsprop")
def _rmsprop(param_groups: List[Dict[str, Any]], cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(param_groups, lr=0.0, momentum=float(cfg.get("momentum", 0.0)),
                               alpha=float(cfg.get("alpha", 0.99)), eps=float(cfg.get("eps", 1e-8)))


def get_param_groups(
    model: nn.Module,
    weight_decay: float,
    regularize_bn: bool = False,
    regularize_bias: bool = True,
    non_regularized_parameters: Iterable[str] = (),
) -> List[Dict[str, Any]]:
    """Trainable parameters split into a weight-decayed group and a wd=0 group.

    A parameter is not regularized when it belongs to a normalization layer and
    ``regularize_bn`` is False, when it is a bias (normalization biases included) and
    ``regularize_bias`` is False, or when
    its full name contains one of ``non_regularized_parameters`` (e.g. 'pos_embed',
    'cls_token'). Empty groups are dropped; shared parameters appear once.
    """
    patterns = [str(p) for p in non_regularized_parameters or []]
    seen = set()
    regularized: List[nn.Parameter] = []
    unregularized: List[nn.Parameter] = []
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, NORM_TYPES)
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            skip = (
                (is_norm and not regularize_bn)
                or (param_name == "bias" and not regularize_bias)
                or any(p in full_name for p in patterns)
            )
            (unregularized if skip else regularized).append(param)
    groups = []
    if regularized:
        groups.append({"params": regularized, "weight_decay": float(weight_decay)})
    if unregularized:
        groups.append({"params": unregularized, "weight_decay": 0.0})
    if not groups:
        raise UserError("the model has no trainable parameters for config.OPTIMIZER to optimize")
    logger.info(
        "optimizer param groups: %d regularized (wd=%g), %d not regularized",
        len(regularized), weight_decay, len(unregularized),
    )
    return groups


class SSLOptimizer:
    """A torch optimizer, the param schedules of its groups, and optional LARC.

    Attributes:
        optimizer: the torch optimizer (usable with ``torch.amp.GradScaler.step(self)``
            too, since this class exposes ``param_groups`` and ``step``).
        update_interval: 'step' or 'epoch': when the trainer should call ``set_where``.
        num_epochs, num_iters_per_epoch: the training length the schedule was built for.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        schedulers: Mapping[str, Callable[[float], float]],
        update_interval: str = "epoch",
        larc_config: Optional[Mapping[str, Any]] = None,
        num_epochs: int = 1,
        num_iters_per_epoch: int = 1,
    ) -> None:
        self.optimizer = optimizer
        self.schedulers = dict(schedulers)
        self.update_interval = update_interval
        self.larc = dict(larc_config) if larc_config is not None else None
        self.num_epochs = num_epochs
        self.num_iters_per_epoch = num_iters_per_epoch
        self._where: Optional[float] = None
        self.set_where(0.0)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def lr(self) -> float:
        """Current learning rate of the first param group."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def where(self) -> Optional[float]:
        """The training progress the scheduled values were last set for."""
        return self._where

    def set_where(self, where: float) -> None:
        """Set every scheduled value (lr, ...) of every group for progress ``where`` in [0, 1).

        ``where >= 1`` (the end of training) leaves the values as they are.
        """
        where = float(where)
        if where < 0:
            raise ValueError(f"where must be in [0, 1), got {where}")
        if where >= 1:
            return
        values = {key: float(sched(where)) for key, sched in self.schedulers.items()}
        for group in self.optimizer.param_groups:
            group.update(values)
        self._where = where

    @torch.no_grad()
    def _larc_step(self, closure: Optional[Callable[[], Any]]) -> Any:
        assert self.larc is not None
        apply_larc_(self.optimizer.param_groups, **self.larc)
        saved = [group.get("weight_decay", 0.0) for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.0  # already inside the LARC gradient
        try:
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        finally:
            for group, wd in zip(self.optimizer.param_groups, saved):
                group["weight_decay"] = wd

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer update with the current scheduled values (LARC first when enabled)."""
        if self.larc is not None:
            if closure is not None:
                raise NotImplementedError("LARC does not support a closure")
            return self._larc_step(None)
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """Torch optimizer state (moments, hyperparameters) and the schedule position."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "where": self._where,
            "update_interval": self.update_interval,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the next ``step()`` equals the uninterrupted one."""
        self.optimizer.load_state_dict(state["optimizer"])
        where = state.get("where")
        if where is not None:
            self.set_where(where)

    # classy_vision naming, used by the task's get_classy_state / set_classy_state
    get_classy_state = state_dict
    set_classy_state = load_state_dict

    def __repr__(self) -> str:
        larc = f", larc={self.larc}" if self.larc is not None else ""
        return (f"SSLOptimizer({type(self.optimizer).__name__}, lr={self.lr:.6g}, "
                f"update_interval={self.update_interval!r}{larc})")


def build_optimizer(
    optimizer_cfg: AttrDict,
    model: nn.Module,
    global_batch_size: int,
    num_iters_per_epoch: int,
    num_nodes: int = 1,
) -> SSLOptimizer:
    """The optimizer ``config.OPTIMIZER`` describes, for ``model``'s trainable parameters.

    ``global_batch_size`` (per-replica batch size times world size) and ``num_nodes`` drive
    ``param_schedulers.lr.auto_lr_scaling``; ``num_iters_per_epoch`` is kept for the
    trainer's ``where`` computation.
    """
    cfg: Mapping[str, Any] = optimizer_cfg
    num_epochs = cfg.get("num_epochs", 90)
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs <= 0:
        raise UserError(f"{OPT_KEY}.num_epochs={num_epochs!r} must be a positive integer (training epochs)")
    if num_iters_per_epoch <= 0:
        raise ValueError(f"num_iters_per_epoch must be positive, got {num_iters_per_epoch}")
    try:
        weight_decay = float(cfg.get("weight_decay", 1e-4))
    except (TypeError, ValueError):
        raise UserError(f"{OPT_KEY}.weight_decay={cfg.get('weight_decay')!r} must be a number") from None
    if weight_decay < 0:
        raise UserError(f"{OPT_KEY}.weight_decay={weight_decay!r} must be >= 0")

    groups = get_param_groups(
        model,
        weight_decay=weight_decay,
        regularize_bn=bool(cfg.get("regularize_bn", False)),
        regularize_bias=bool(cfg.get("regularize_bias", True)),
        non_regularized_parameters=cfg.get("non_regularized_parameters", []) or [],
    )
    builder: OptimizerBuilder = OPTIMIZERS.get(cfg.get("name", "sgd"))
    torch_optimizer = builder(groups, cfg)

    schedulers_cfg = cfg.get("param_schedulers") or {}
    lr_cfg = schedulers_cfg.get("lr")
    if not lr_cfg:
        raise UserError(f"{OPT_KEY}.param_schedulers.lr is required (e.g. name: constant, value: 0.1)")
    lr_scheduler, interval = build_lr_scheduler(lr_cfg, num_epochs, global_batch_size, num_nodes)

    larc = parse_larc_config(cfg.get("larc_config") or {}) if cfg.get("use_larc", False) else None
    optimizer = SSLOptimizer(
        torch_optimizer,
        {"lr": lr_scheduler},
        update_interval=interval,
        larc_config=larc,
        num_epochs=num_epochs,
        num_iters_per_epoch=num_iters_per_epoch,
    )
    logger.info("built %r", optimizer)
    return optimizer
