"""The optimizer a task trains with: a torch optimizer plus its lr schedule and LARC.

``build_optimizer`` reads ``config.OPTIMIZER`` (VISSL's keys), splits the model's
parameters into regularized and non-regularized groups, builds the torch optimizer
through the OPTIMIZERS registry and the lr schedule through :mod:`.schedulers`.
With ``head_optimizer_params.use_different_lr`` or ``use_different_wd`` the heads' parameters
get groups of their own (VISSL's head param groups): their lr follows
``param_schedulers.lr_head`` (with use_different_lr) and their weight decay is
``head_optimizer_params.weight_decay`` (with use_different_wd). LARC works per group, so
it uses each group's own lr and weight decay.

The trainer owns training progress: it calls ``set_where(where)`` before a step (for
``update_interval == 'step'``) or at the start of a train phase (for 'epoch'), then
``step()``. Everything needed to resume exactly is in ``state_dict()``, made of tensors
and plain containers so that ``torch.load(weights_only=True)`` reads it.
"""

import logging
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.optim.larc import apply_larc_, parse_larc_config
from ssl_engine.optim.schedulers import build_lr_scheduler
from ssl_engine.registry import OPTIMIZERS

logger = logging.getLogger(__name__)

OPT_KEY = "config.OPTIMIZER"
# optimizers that keep the same per-parameter state (a resume may switch between them)
_SAME_STATE = {"Adam", "AdamW"}
# param group entries that are not an optimizer's hyperparameters (torch adds such flags over versions)
_TORCH_GROUP_FLAGS = {"params", "foreach", "differentiable", "fused", "maximize", "capturable", "initial_lr",
                      "decoupled_weight_decay"}

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


def _momentum(cfg: Mapping[str, Any], default: float) -> float:
    """``momentum`` of config.OPTIMIZER, in [0, 1): torch checks only >= 0, and 1 or more grows
    the steps without bound."""
    momentum = float(cfg.get("momentum", default))
    if not 0.0 <= momentum < 1.0:
        raise UserError(f"{OPT_KEY}.momentum={momentum!r} must be in [0, 1)")
    return momentum


# Registered builders take (param_groups, config.OPTIMIZER) and return a torch optimizer.
# Group dicts already hold weight_decay; lr is set by the schedule before any step.
@OPTIMIZERS.register("sgd")
def _sgd(param_groups: List[Dict[str, Any]], cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    momentum = _momentum(cfg, 0.9)
    nesterov = bool(cfg.get("nesterov", False))
    if nesterov and momentum == 0:
        raise UserError(f"{OPT_KEY}.nesterov=True needs {OPT_KEY}.momentum > 0")
    return torch.optim.SGD(param_groups, lr=0.0, momentum=momentum, nesterov=nesterov)


def _betas(cfg: Mapping[str, Any]) -> tuple:
    betas = cfg.get("betas", [0.9, 0.999])
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise UserError(f"{OPT_KEY}.betas={betas!r} must be a list of two numbers, e.g. [0.9, 0.999]")
    try:
        out = (float(betas[0]), float(betas[1]))
    except (TypeError, ValueError):
        raise UserError(f"{OPT_KEY}.betas={list(betas)!r} must be a list of two numbers, e.g. [0.9, 0.999]") from None
    if not all(0.0 <= b < 1.0 for b in out):  # torch's own check raised in every rank, after launch
        raise UserError(f"{OPT_KEY}.betas={list(betas)!r}: each beta must be in [0, 1), e.g. [0.9, 0.999]")
    return out


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
    return torch.optim.RMSprop(param_groups, lr=0.0, momentum=_momentum(cfg, 0.0),
                               alpha=float(cfg.get("alpha", 0.99)), eps=float(cfg.get("eps", 1e-8)))


def _head_param_ids(model: nn.Module) -> Set[int]:
    """Ids of the parameters of the model's heads: its ``heads`` submodule (SSLModel's), or for a
    model without one, the modules whose name contains 'head' (VISSL's rule)."""
    heads = getattr(model, "heads", None)
    if isinstance(heads, nn.Module):
        return {id(p) for p in heads.parameters()}
    return {id(p) for name, module in model.named_modules() if "head" in name for p in module.parameters(recurse=False)}


def get_param_groups(
    model: nn.Module,
    weight_decay: float,
    regularize_bn: bool = False,
    regularize_bias: bool = True,
    non_regularized_parameters: Iterable[str] = (),
    head_weight_decay: Optional[float] = None,
) -> List[Dict[str, Any]]:
    """Trainable parameters split into a weight-decayed group and a wd=0 group.

    A parameter is not regularized when it belongs to a normalization layer and
    ``regularize_bn`` is False, when it is a bias (normalization biases included) and
    ``regularize_bias`` is False, or when
    its full name contains one of ``non_regularized_parameters`` (e.g. 'pos_embed',
    'cls_token'). Empty groups are dropped; shared parameters appear once.

    With ``head_weight_decay`` (not None), the heads' parameters (see :func:`_head_param_ids`)
    get groups of their own, as VISSL's head_optimizer_params make them: regularized ones with
    ``head_weight_decay``, the others with 0. Each group dict then holds a ``name``
    ("trunk", "trunk_no_wd", "head", "head_no_wd"), which says which lr schedule drives it
    (``lr`` or ``lr_head``). Without it the groups are named "regularized" and "not_regularized".
    """
    patterns = [str(p) for p in non_regularized_parameters or []]
    split_heads = head_weight_decay is not None
    head_ids = _head_param_ids(model) if split_heads else set()
    seen = set()
    buckets: Dict[Tuple[bool, bool], List[nn.Parameter]] = {
        (h, r): [] for h in (False, True) for r in (True, False)
    }
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
            buckets[(id(param) in head_ids, not skip)].append(param)
    names = {
        (False, True): "trunk" if split_heads else "regularized",
        (False, False): "trunk_no_wd" if split_heads else "not_regularized",
        (True, True): "head",
        (True, False): "head_no_wd",
    }
    groups = []
    for (is_head, regularized), params in buckets.items():
        if params:
            wd = (float(head_weight_decay) if is_head else float(weight_decay)) if regularized else 0.0
            groups.append({"params": params, "weight_decay": wd, "name": names[(is_head, regularized)]})
    if not groups:
        raise UserError(f"the model has no trainable parameters for config.OPTIMIZER to optimize: {_why_frozen(model)}")
    return groups


def _why_frozen(model: nn.Module) -> str:
    """What froze every parameter of ``model``, and what to do about it (for the error above)."""
    fes = "config.MODEL.FEATURE_EVAL_SETTINGS"
    evaluate = ("a config for evaluating features without training (VISSL's kNN benchmark) runs with "
                "--engine=extract_features or tools/nearest_neighbor_test.py")
    if getattr(model, "heads_frozen", False):
        return f"{fes}.FREEZE_TRUNK_AND_HEAD=true freezes the trunk and the heads; {evaluate}"
    if getattr(model, "trunk_frozen", False) and len(getattr(model, "heads", ())) == 0:
        return (f"{fes}.FREEZE_TRUNK_ONLY=true freezes the trunk and config.MODEL.HEAD.PARAMS gives no head to train; "
                f"add a head, or: {evaluate}")
    return "config.MODEL.NON_TRAINABLE_PARAMS (or a frozen trunk) leaves nothing to train"


class SSLOptimizer:
    """A torch optimizer, the param schedules of its groups, and optional LARC.

    ``schedulers`` maps a schedule name ("lr", "lr_head") to a ParamScheduler; ``group_params``
    says, for each param group, which group value each schedule sets (``{"lr": "lr_head"}``:
    the group's lr follows the lr_head schedule); by default every group's ``lr`` follows "lr".
    ``intervals`` gives each schedule's update interval; the optimizer's ``update_interval`` is
    'step' when any schedule updates every step, and then a schedule of interval 'epoch' keeps
    the value of the start of the current epoch.

    Attributes:
        optimizer: the torch optimizer (usable with ``torch.amp.GradScaler.step(self)``
            too, since this class exposes ``param_groups`` and ``step``).
        update_interval: 'step' or 'epoch': when the trainer should call ``set_where``.
        num_epochs, num_iters_per_epoch: the training length the schedule was built for.
        group_names: a name per param group (for the log), e.g. "trunk", "head_no_wd".
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        schedulers: Mapping[str, Callable[[float], float]],
        update_interval: str = "epoch",
        larc_config: Optional[Mapping[str, Any]] = None,
        num_epochs: int = 1,
        num_iters_per_epoch: int = 1,
        group_params: Optional[List[Mapping[str, str]]] = None,
        intervals: Optional[Mapping[str, str]] = None,
        group_names: Optional[List[str]] = None,
    ) -> None:
        self.optimizer = optimizer
        self.schedulers = dict(schedulers)
        n_groups = len(optimizer.param_groups)
        if group_params is None:
            group_params = [{key: key for key in self.schedulers} for _ in range(n_groups)]
        if len(group_params) != n_groups:
            raise ValueError(f"group_params has {len(group_params)} entries for {n_groups} param groups")
        self.group_params = [dict(m) for m in group_params]
        unknown = {name for m in self.group_params for name in m.values()} - set(self.schedulers)
        if unknown:
            raise ValueError(f"group_params name schedules {sorted(unknown)} that are not in schedulers")
        self.intervals = {key: (intervals or {}).get(key, update_interval) for key in self.schedulers}
        if "step" in self.intervals.values():
            update_interval = "step"
        self.update_interval = update_interval
        self.group_names = list(group_names) if group_names is not None else [str(i) for i in range(n_groups)]
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
        values = {}
        for key, sched in self.schedulers.items():
            at = where
            if self.update_interval == "step" and self.intervals[key] == "epoch":
                at = math.floor(where * self.num_epochs + 1e-9) / self.num_epochs  # the epoch's start
            values[key] = float(sched(at))
        for group, params in zip(self.optimizer.param_groups, self.group_params):
            for group_key, sched_key in params.items():
                group[group_key] = values[sched_key]
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
            "optimizer_class": type(self.optimizer).__name__,
            "where": self._where,
            "update_interval": self.update_interval,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the next ``step()`` equals the uninterrupted one."""
        saved = len((state.get("optimizer") or {}).get("param_groups") or [])
        if saved != len(self.optimizer.param_groups):
            raise CheckpointError(
                f"the checkpoint's optimizer has {saved} param groups but {OPT_KEY} gives "
                f"{len(self.optimizer.param_groups)} ({', '.join(self.group_names)}); resume with the "
                f"checkpoint's {OPT_KEY}.head_optimizer_params and trainable parameters"
            )
        saved_groups = state["optimizer"]["param_groups"]
        self._check_same_kind(saved_groups, state.get("optimizer_class"))
        self._check_shapes(state["optimizer"])
        # the config's values (momentum, weight_decay, betas, ...) win over the checkpoint's, as they
        # do in VISSL, whose schedules set every value again at the next step; the scheduled ones
        # are set below for the checkpoint's position
        config_values = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        scheduled = {k for params in self.group_params for k in params}
        changed = set()
        for group, values, old in zip(self.optimizer.param_groups, config_values, saved_groups):
            for key, value in values.items():
                if key not in scheduled and key in old and old[key] != value:
                    changed.add(f"{key} {old[key]!r} -> {value!r}")
            group.update(values)
        if changed:
            logger.warning("%s differs from the checkpoint's optimizer; the run goes on with the config's values: %s",
                           OPT_KEY, ", ".join(sorted(changed)))
        where = state.get("where")
        if where is not None:
            self.set_where(where)

    def _check_shapes(self, saved: Mapping[str, Any]) -> None:
        """Each saved per-parameter tensor (momentum buffer, moments) has its parameter's shape.

        torch's own load matches the state to the parameters by position and checks only the
        group sizes: state of other tensors would load and fail (or train wrongly) later.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        saved_ids = [i for g in saved["param_groups"] for i in g.get("params", [])]
        if len(saved_ids) != len(params):
            raise CheckpointError(
                f"the checkpoint's optimizer holds {len(saved_ids)} parameters, this model trains {len(params)}"
            )
        position = {pid: n for n, pid in enumerate(saved_ids)}
        per_param = saved.get("state") or {}
        if not isinstance(per_param, Mapping):
            raise CheckpointError(f"the checkpoint's optimizer state is a {type(per_param).__name__}, not a mapping "
                                  f"of parameters")
        for pid, values in per_param.items():
            n = position.get(pid)
            if n is None or not isinstance(values, Mapping):
                continue
            for name, value in values.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape != params[n].shape:
                    raise CheckpointError(
                        f"the checkpoint's optimizer state does not fit this model: its {name} of parameter {n} "
                        f"has shape {list(value.shape)}, the parameter {list(params[n].shape)}"
                    )

    def _check_same_kind(self, saved_groups: List[Mapping[str, Any]], saved_class: Optional[str]) -> None:
        """A checkpoint of another optimizer (sgd against adam, lars, ...) cannot give this one its
        state (its moments have other names): a CheckpointError naming the key, not a KeyError."""
        ours = type(self.optimizer).__name__
        if saved_class is not None:
            missing: Set[str] = set()
        else:  # a checkpoint written before the class was stored: its groups' hyperparameter names say
            keys = lambda groups: {k for g in groups for k in g if k not in _TORCH_GROUP_FLAGS}  # noqa: E731
            missing = keys(self.optimizer.param_groups) - keys(saved_groups)
        same_state = saved_class is None or saved_class == ours or {saved_class, ours} <= _SAME_STATE
        if same_state and not missing:
            return
        theirs = f"{saved_class}'s" if saved_class else f"another optimizer's (no {', '.join(sorted(missing))})"
        raise CheckpointError(
            f"{OPT_KEY}.name gives {ours} but the checkpoint holds {theirs} state; resume with the optimizer "
            f"it was trained with, or start a new CHECKPOINT.DIR from its weights "
            f"(config.MODEL.WEIGHTS_INIT.PARAMS_FILE=<checkpoint>) to change the optimizer"
        )

    # classy_vision naming, used by the task's get_classy_state / set_classy_state
    get_classy_state = state_dict
    set_classy_state = load_state_dict

    def describe_groups(self) -> str:
        """One phrase per param group: its name, size, values now and the schedules behind them."""
        parts = []
        for name, group, params in zip(self.group_names, self.optimizer.param_groups, self.group_params):
            scheduled = ", ".join(
                f"{k}={float(group[k]):.6g} ({v}, per {self.intervals[v]})" for k, v in params.items()
            )
            parts.append(f"{name}: {len(group['params'])} tensors, {scheduled}, "
                         f"weight_decay={float(group.get('weight_decay', 0.0)):.6g}")
        return "; ".join(parts)

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

    head_cfg = cfg.get("head_optimizer_params") or {}
    use_different_lr = bool(head_cfg.get("use_different_lr", False))
    use_different_wd = bool(head_cfg.get("use_different_wd", False))
    head_wd: Optional[float] = None
    if use_different_lr or use_different_wd:  # else the heads' groups would equal the trunk's
        head_wd = weight_decay
        if use_different_wd:
            try:
                head_wd = float(head_cfg.get("weight_decay", weight_decay))
            except (TypeError, ValueError):
                raise UserError(f"{OPT_KEY}.head_optimizer_params.weight_decay={head_cfg.get('weight_decay')!r} "
                                "must be a number") from None
            if head_wd < 0:
                raise UserError(f"{OPT_KEY}.head_optimizer_params.weight_decay={head_wd!r} must be >= 0")
    if cfg.get("construct_single_param_group_only", False):
        if use_different_lr or use_different_wd:  # VISSL's single group ignores them: they would not act
            raise UserError(f"{OPT_KEY}.construct_single_param_group_only=true puts every parameter in one group, "
                            f"which leaves no group for {OPT_KEY}.head_optimizer_params.use_different_lr / "
                            f"use_different_wd: set one of them to false")
        # VISSL's one group (made for FSDP's flattened parameters): weight decay on every parameter,
        # normalization weights and biases too, whatever regularize_bn/_bias and
        # non_regularized_parameters say
        groups = get_param_groups(model, weight_decay, regularize_bn=True, regularize_bias=True)
        logger.info("%s.construct_single_param_group_only: one param group, weight_decay=%g on every parameter "
                    "(regularize_bn, regularize_bias and non_regularized_parameters are not read, as in VISSL)",
                    OPT_KEY, weight_decay)
    else:
        groups = get_param_groups(
            model,
            weight_decay=weight_decay,
            regularize_bn=bool(cfg.get("regularize_bn", False)),
            regularize_bias=bool(cfg.get("regularize_bias", True)),
            non_regularized_parameters=cfg.get("non_regularized_parameters", []) or [],
            head_weight_decay=head_wd,
        )
    group_names = [g.pop("name") for g in groups]  # kept out of the torch state dict
    builder: OptimizerBuilder = OPTIMIZERS.get(cfg.get("name", "sgd"))
    torch_optimizer = builder(groups, cfg)

    schedulers_cfg = cfg.get("param_schedulers") or {}
    lr_cfg = schedulers_cfg.get("lr")
    if not lr_cfg:
        raise UserError(f"{OPT_KEY}.param_schedulers.lr is required (e.g. name: constant, value: 0.1)")
    lr_scheduler, interval = build_lr_scheduler(lr_cfg, num_epochs, global_batch_size, num_nodes)
    schedulers: Dict[str, Any] = {"lr": lr_scheduler}
    intervals = {"lr": interval}
    group_params = [{"lr": "lr"} for _ in groups]
    if use_different_lr:
        key = f"{OPT_KEY}.param_schedulers.lr_head"
        head_lr_cfg = schedulers_cfg.get("lr_head")
        if not head_lr_cfg:
            raise UserError(f"{key} is required with {OPT_KEY}.head_optimizer_params.use_different_lr=true")
        schedulers["lr_head"], intervals["lr_head"] = build_lr_scheduler(
            head_lr_cfg, num_epochs, global_batch_size, num_nodes, key=key)
        group_params = [{"lr": "lr_head" if n.startswith("head") else "lr"} for n in group_names]
        if not any(n.startswith("head") for n in group_names):
            logger.warning("%s.head_optimizer_params.use_different_lr: the model has no trainable head "
                           "parameters, so %s is not used", OPT_KEY, key)

    larc = parse_larc_config(cfg.get("larc_config") or {}) if cfg.get("use_larc", False) else None
    optimizer = SSLOptimizer(
        torch_optimizer,
        schedulers,
        update_interval=interval,
        larc_config=larc,
        num_epochs=num_epochs,
        num_iters_per_epoch=num_iters_per_epoch,
        group_params=group_params,
        intervals=intervals,
        group_names=group_names,
    )
    logger.info("built %r; param groups: %s", optimizer, optimizer.describe_groups())
    return optimizer
