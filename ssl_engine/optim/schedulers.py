"""Learning-rate schedules from ``config.OPTIMIZER.param_schedulers.lr``.

A schedule maps training progress ``where`` in [0, 1) to a value, so the same config
works for any number of epochs or iterations. The schedule classes are classy_vision's
(re-exported from fvcore); this module validates the VISSL-style config, turns it into
those objects, and implements VISSL's automatic learning-rate scaling with batch size.
"""

import bisect
import copy
import logging
import math
from typing import Any, Dict, List, Mapping, Tuple

from classy_vision.optim.param_scheduler import (
    PARAM_SCHEDULER_REGISTRY,
    CompositeParamScheduler,
    ConstantParamScheduler,
    CosineParamScheduler,
    LinearParamScheduler,
    MultiStepParamScheduler,
    ParamScheduler,
    StepParamScheduler,
)

from ssl_engine.errors import UserError

logger = logging.getLogger(__name__)

LR_KEY = "config.OPTIMIZER.param_schedulers.lr"
UPDATE_INTERVALS = ("step", "epoch")
INTERVAL_SCALINGS = ("rescaled", "fixed")
SCALING_TYPES = ("linear", "sqrt")

# Config keys holding learning-rate values, per schedule name (auto scaling multiplies them).
_VALUE_KEYS: Dict[str, Tuple[str, ...]] = {
    "constant": ("value",),
    "step": ("values",),
    "multistep": ("values",),
    "linear": ("start_value", "end_value"),
    "cosine": ("start_value", "end_value"),
    "cosine_warm_restart": ("start_value", "end_value"),
    "polynomial": ("base_value",),
    "step_with_fixed_gamma": ("base_value",),
    "inverse_sqrt": ("start_value",),
}


WAVE_TYPES = ("half", "full")


class CosineWarmRestartParamScheduler(ParamScheduler):
    """Cosine annealing with warm restarts (SGDR), VISSL's ``cosine_warm_restart`` schedule.

    Training progress ``where`` in [0, 1) is cut into intervals of ``restart_interval_length``
    (a fraction of training). ``half``: in each interval the value falls along half a cosine
    from the interval's peak to ``end_value``, then jumps back up. ``full``: a whole cosine of
    period twice the interval, down to ``end_value`` and back up; its peak changes where the
    value bottoms out. The first peak is ``start_value``; the one after ``k`` restarts is
    ``start_value * lr_multiplier ** k``, or with ``is_adaptive`` the value a plain cosine from
    ``start_value`` to ``end_value`` would have there, so the peaks follow that one curve.
    The values are VISSL's for the same keys, so its configs train with the same learning rates.
    """

    def __init__(
        self,
        start_value: float,
        end_value: float,
        restart_interval_length: float,
        wave_type: str = "half",
        lr_multiplier: float = 1.0,
        is_adaptive: bool = False,
    ) -> None:
        super().__init__()
        if not restart_interval_length > 0.0:
            raise ValueError(f"restart_interval_length={restart_interval_length} must be > 0 (a fraction of training)")
        if wave_type not in WAVE_TYPES:
            raise ValueError(f"wave_type={wave_type!r} must be one of {', '.join(WAVE_TYPES)}")
        self.end_value = end_value
        self.interval = restart_interval_length
        self.wave_type = wave_type
        # where each peak starts: every interval (half); at 0, then every second interval from
        # the first trough on (full)
        first, every = (self.interval, self.interval) if wave_type == "half" else (self.interval, 2 * self.interval)
        self.restarts = [0.0]
        while first + every * (len(self.restarts) - 1) < 1.0:
            self.restarts.append(first + every * (len(self.restarts) - 1))
        # adaptive: the plain cosine at the restart (half), or one interval past it (full, as
        # VISSL computes it: so even the first peak of a full wave is below start_value)
        offset = 0.0 if wave_type == "half" else self.interval
        self.peaks = [
            end_value + 0.5 * (start_value - end_value) * (1.0 + math.cos(math.pi * (r + offset)))
            if is_adaptive else start_value * lr_multiplier ** k
            for k, r in enumerate(self.restarts)
        ]

    def __call__(self, where: float) -> float:
        k = max(0, bisect.bisect_right(self.restarts, where) - 1)
        phase = (where % self.interval) / self.interval if self.wave_type == "half" else where / self.interval
        return self.end_value + 0.5 * (self.peaks[k] - self.end_value) * (1.0 + math.cos(math.pi * phase))


class InverseSqrtParamScheduler(ParamScheduler):
    """VISSL's ``inverse_sqrt`` schedule: the value falls as the inverse square root of training
    progress, ``start_value * sqrt(warmup_interval_length / where)``, so it equals ``start_value``
    at ``where == warmup_interval_length`` (a fraction of training; 0: ``start_value / sqrt(where)``).
    At ``where == 0`` it is ``start_value * sqrt(warmup_interval_length)`` (``start_value`` for 0).
    It usually follows a linear warm-up in a composite schedule with ``interval_scaling: fixed``.
    """

    def __init__(self, start_value: float, warmup_interval_length: float) -> None:
        super().__init__()
        if not (math.isfinite(warmup_interval_length) and warmup_interval_length >= 0.0):
            raise ValueError(f"warmup_interval_length={warmup_interval_length} must be a fraction of training >= 0")
        self.decay_factor = start_value * math.sqrt(warmup_interval_length) if warmup_interval_length > 0 else start_value

    def __call__(self, where: float) -> float:
        return self.decay_factor / math.sqrt(where) if where > 0 else self.decay_factor


def scheduler_names() -> List[str]:
    """Schedule names a config may use: ours plus any registered with classy_vision."""
    return sorted(set(_VALUE_KEYS) | {"composite"} | set(PARAM_SCHEDULER_REGISTRY))


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if cfg.get(key) is None:
        raise UserError(f"{where}.{key} is required for the {cfg.get('name')!r} schedule")
    return cfg[key]


def _number(value: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{key}={value!r} must be a number") from None


def _milestone(value: Any, key: str) -> float:
    """A multistep milestone, in epochs. One that is not a whole number is kept as it is: it takes
    effect as the next whole epoch starts (1.5: at epoch 2), as classy_vision's
    MultiStepParamScheduler reads it, so a VISSL config gets VISSL's schedule."""
    number = _number(value, key)
    if isinstance(value, bool) or not math.isfinite(number):
        raise UserError(f"{key}={value!r} must be a number of epochs")
    return int(number) if number.is_integer() else number


def _milestone_advice(ms: List[float], num_epochs: int, where: str) -> str:
    """The end of the milestones error where they do not fit into ``num_epochs``: how to fix it."""
    if not ms or ms[-1] < num_epochs or any(b <= a for a, b in zip(ms, ms[1:])):
        return ""  # not increasing: the message says what is wanted
    if len(ms) < num_epochs:
        return f"; raise config.OPTIMIZER.num_epochs above {ms[-1]} or give milestones below {num_epochs}"
    room = (f"leaves room for {num_epochs - 1} milestone(s)" if num_epochs > 1 else
            "leaves no epoch for a milestone")
    return (f"; num_epochs={num_epochs} {room}: raise config.OPTIMIZER.num_epochs above {ms[-1]}, or give "
            f"fewer milestones and values ({where}.milestones=[] with one value keeps it throughout)")


def _numbers(values: Any, key: str) -> List[float]:
    if not isinstance(values, (list, tuple)) or not values:
        raise UserError(f"{key}={values!r} must be a non-empty list of numbers")
    return [_number(v, f"{key}[{i}]") for i, v in enumerate(values)]


def build_param_scheduler(cfg: Mapping[str, Any], num_epochs: int, where: str = LR_KEY) -> ParamScheduler:
    """The ParamScheduler a schedule config describes.

    ``num_epochs`` is the length of training: step/multistep milestones are in epochs.
    ``where`` is the config path used in error messages (composite children get
    ``...schedulers[i]``).
    """
    name = cfg.get("name")
    if name not in scheduler_names():
        raise UserError(f"{where}.name={name!r} is not a known schedule; valid: {', '.join(scheduler_names())}")
    try:
        if name == "constant":
            return ConstantParamScheduler(value=_number(_require(cfg, "value", where), f"{where}.value"))
        if name in ("linear", "cosine"):
            cls = LinearParamScheduler if name == "linear" else CosineParamScheduler
            return cls(
                start_value=_number(_require(cfg, "start_value", where), f"{where}.start_value"),
                end_value=_number(_require(cfg, "end_value", where), f"{where}.end_value"),
            )
        if name == "step":
            values = _numbers(_require(cfg, "values", where), f"{where}.values")
            return StepParamScheduler(num_updates=num_epochs, values=values)
        if name == "multistep":
            values = _numbers(_require(cfg, "values", where), f"{where}.values")
            milestones = cfg.get("milestones")
            if milestones is not None and len(milestones) != len(values) - 1:
                raise UserError(
                    f"{where}.milestones={list(milestones)} must have one entry fewer than "
                    f"{where}.values ({len(values)} values)"
                )
            ms = None if milestones is None else [_milestone(m, f"{where}.milestones[{i}]")
                                                  for i, m in enumerate(milestones)]
            if ms is not None and (any(b <= a for a, b in zip([0] + ms, ms)) or (ms and ms[-1] >= num_epochs)):
                raise UserError(
                    f"{where}.milestones={ms} must be increasing epochs in (0, {num_epochs}) "
                    f"for config.OPTIMIZER.num_epochs={num_epochs}" + _milestone_advice(ms, num_epochs, where)
                )
            if len(values) > num_epochs:  # classy: "Total num_updates must be greater than length of param schedule"
                raise UserError(
                    f"{where}.values has {len(values)} values, but config.OPTIMIZER.num_epochs={num_epochs} has room "
                    f"for {num_epochs}, one per epoch at most: raise num_epochs, or give fewer values and milestones "
                    f"({where}.milestones=[] with one value keeps it throughout)"
                )
            return MultiStepParamScheduler(values=values, num_updates=num_epochs, milestones=ms)
        if name == "cosine_warm_restart":
            return CosineWarmRestartParamScheduler(
                start_value=_number(_require(cfg, "start_value", where), f"{where}.start_value"),
                end_value=_number(_require(cfg, "end_value", where), f"{where}.end_value"),
                restart_interval_length=_number(
                    _require(cfg, "restart_interval_length", where), f"{where}.restart_interval_length"),
                wave_type=str(cfg.get("wave_type") or "half"),
                lr_multiplier=_number(cfg.get("lr_multiplier", 1.0), f"{where}.lr_multiplier"),
                is_adaptive=bool(cfg.get("is_adaptive", False)),
            )
        if name == "inverse_sqrt":
            return InverseSqrtParamScheduler(
                start_value=_number(_require(cfg, "start_value", where), f"{where}.start_value"),
                warmup_interval_length=_number(
                    _require(cfg, "warmup_interval_length", where), f"{where}.warmup_interval_length"),
            )
        if name == "composite":
            return _build_composite(cfg, num_epochs, where)
        # Any other schedule registered with classy_vision (polynomial, step_with_fixed_gamma, ...).
        for key in _READS.get(name, ()):
            _require(cfg, key, where)
        plain = dict(cfg)
        plain.pop("update_interval", None)
        plain.pop("auto_lr_scaling", None)
        plain["num_epochs"] = num_epochs
        return PARAM_SCHEDULER_REGISTRY[name].from_config(plain)
    except UserError:
        raise
    except (ValueError, AssertionError, TypeError, KeyError) as err:
        raise UserError(f"{where} (name={name!r}) is invalid: {err}") from None


def _build_composite(cfg: Mapping[str, Any], num_epochs: int, where: str) -> ParamScheduler:
    children = cfg.get("schedulers") or []
    lengths = cfg.get("lengths") or []
    if not children:
        raise UserError(f"{where}.schedulers must list the schedules a composite schedule runs in order")
    if len(lengths) != len(children):
        raise UserError(
            f"{where}.lengths={list(lengths)} must give one fraction of training per entry of "
            f"{where}.schedulers ({len(children)} schedules)"
        )
    lengths = _numbers(lengths, f"{where}.lengths")
    if any(not math.isfinite(v) or v < 0 for v in lengths):
        # [1.5, -0.5] sums to 1: the first schedule stretched over the whole run, the second never reached
        raise UserError(f"{where}.lengths={lengths} must be fractions of training >= 0 (summing to 1)")
    if abs(sum(lengths) - 1.0) > 1e-3:
        raise UserError(f"{where}.lengths={lengths} must sum to 1 (they sum to {sum(lengths):g})")
    lengths[-1] = 1.0 - sum(lengths[:-1])  # absorb rounding so the last phase ends at 1
    scaling = list(cfg.get("interval_scaling") or []) or ["rescaled"] * len(children)
    if len(scaling) != len(children) or any(s not in INTERVAL_SCALINGS for s in scaling):
        raise UserError(
            f"{where}.interval_scaling={scaling} must hold one of {INTERVAL_SCALINGS} per schedule "
            f"({len(children)} schedules), or be empty for all 'rescaled'"
        )
    for i, child in enumerate(children):
        _check_child_options(child, f"{where}.schedulers[{i}]")
    built = [build_param_scheduler(child, num_epochs, f"{where}.schedulers[{i}]") for i, child in enumerate(children)]
    return CompositeParamScheduler(schedulers=built, lengths=lengths, interval_scaling=scaling)


#: keys a composite's child may hold besides the options its schedule reads (classy reads them on any schedule)
_CHILD_KEYS = ("name", "update_interval", "num_epochs")


def _check_child_options(child: Any, where: str) -> None:
    """A UserError naming the options of a composite's child that its schedule does not read.

    A child is written in full by the user (no defaults fill it), so such an option is a typo
    (``end_vlaue``) or meant for another schedule, and the run would silently train without it.
    Schedules registered by users are not checked (their options are unknown here).
    """
    if not isinstance(child, Mapping):
        raise UserError(f"{where}={child!r} must be a schedule: a mapping with a name and its options")
    reads = _READS.get(str(child.get("name")))
    if reads is None:
        return
    unread = [str(k) for k in child if k not in reads and k not in _CHILD_KEYS]
    if unread:
        raise UserError(f"{where}: {', '.join(unread)} {'is not an option' if len(unread) == 1 else 'are not options'} "
                        f"of the {child.get('name')!r} schedule (it reads {', '.join(reads)})")


def _check_children(cfg: Mapping[str, Any], where: str) -> None:
    """:func:`_check_child_options` on every child of a composite schedule, nested ones too."""
    if cfg.get("name") != "composite":
        return
    for i, child in enumerate(cfg.get("schedulers") or []):
        _check_child_options(child, f"{where}.schedulers[{i}]")
        _check_children(child, f"{where}.schedulers[{i}]")


def _lr_values(cfg: Mapping[str, Any]) -> List[float]:
    """Every learning-rate value in a schedule config, composite children included."""
    name = cfg.get("name")
    if name == "composite":
        return [v for child in cfg.get("schedulers") or [] for v in _lr_values(child)]
    found: List[float] = []
    for key in _VALUE_KEYS.get(name, ()):
        value = cfg.get(key)
        if isinstance(value, (list, tuple)):
            found.extend(float(v) for v in value)
        elif value is not None:
            found.append(float(value))
    return found


def _multiply(cfg: Dict[str, Any], factor: float) -> None:
    """Multiply every learning-rate value of a schedule config in place."""
    if cfg.get("name") == "composite":
        for child in cfg.get("schedulers") or []:
            _multiply(child, factor)
        return
    for key in _VALUE_KEYS.get(cfg.get("name"), ()):
        value = cfg.get(key)
        if isinstance(value, (list, tuple)):
            cfg[key] = [float(v) * factor for v in value]
        elif value is not None:
            cfg[key] = float(value) * factor


def scale_lr_schedule(
    lr_cfg: Mapping[str, Any], global_batch_size: int, num_nodes: int = 1, key: str = LR_KEY
) -> Dict[str, Any]:
    """A copy of ``lr_cfg`` with VISSL's auto_lr_scaling applied (unchanged when off).

    With ``auto_lr_scaling.auto_scale``, the reference rate ``base_value`` (meant for a
    batch of ``base_lr_batch_size``) becomes

        scaled_lr = base_value * (global_batch_size / base_lr_batch_size)      (linear)
        scaled_lr = base_value * sqrt(global_batch_size / base_lr_batch_size)  (sqrt)

    and each schedule is scaled by VISSL's rule for its type (:func:`_scale_as_vissl`): a cosine
    starts at scaled_lr and keeps its end/start ratio, multistep/step values become
    ``scaled_lr * gamma**i`` with ``gamma = values[1] / values[0]``, a constant is scaled_lr,
    and each part of a composite is scaled so on its own.
    For the usual configs (a peak equal to ``base_value``, geometric multistep values) that is
    multiplying every value by the batch-size factor; where VISSL's rule changes the shape
    written in the config (non-geometric values, a composite part that does not start at the
    peak) a warning gives both.

    A linear warm-up inside a composite schedule is resolved as VISSL resolves it (see
    :func:`_resolve_linear_warmup`): it ends at scaled_lr and starts at the lr scaled for one
    node's batch (``global_batch_size / num_nodes``), so on a single node, where the two are
    equal, the warm-up is left out.

    ``key`` is the schedule's config path (``...param_schedulers.lr`` or ``...lr_head``, which
    VISSL scales the same way by its own ``auto_lr_scaling``), for messages.
    """
    cfg = _plain(lr_cfg)
    auto = cfg.get("auto_lr_scaling") or {}
    if not auto.get("auto_scale", False):
        return cfg
    sched_key = key
    key = f"{sched_key}.auto_lr_scaling"
    scaling_type = auto.get("scaling_type", "linear")
    if scaling_type not in SCALING_TYPES:
        raise UserError(f"{key}.scaling_type={scaling_type!r} is not valid; use one of {', '.join(SCALING_TYPES)}")
    base_bs = auto.get("base_lr_batch_size", 256)
    if not isinstance(base_bs, (int, float)) or base_bs <= 0:
        raise UserError(f"{key}.base_lr_batch_size={base_bs!r} must be a positive number")
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    base_value = _number(auto.get("base_value", 0.1), f"{key}.base_value")
    if not math.isfinite(base_value) or base_value < 0:  # else "the schedule gives a negative lr", not naming it
        raise UserError(f"{key}.base_value={base_value:g} must be a learning rate >= 0 (the lr at "
                        f"base_lr_batch_size={base_bs:g})")
    ratio = global_batch_size / float(base_bs)
    factor = math.sqrt(ratio) if scaling_type == "sqrt" else ratio
    scaled_lr = base_value * factor
    peak = max(_lr_values(cfg), default=0.0)
    if peak <= 0:
        logger.warning("auto_lr_scaling: the lr schedule has no positive value; left unscaled")
        return cfg
    as_written = copy.deepcopy(cfg)
    _multiply(as_written, scaled_lr / peak)
    _scale_as_vissl(cfg, scaled_lr, scaled_lr / peak)
    _warn_reshaped(cfg, as_written, sched_key)
    logger.info(
        "%s.auto_lr_scaling (%s): global batch %d / base batch %g -> scale %.6g; "
        "lr base_value %.6g -> scaled lr %.6g (schedule peak %.6g -> %.6g)",
        sched_key, scaling_type, global_batch_size, base_bs, factor, base_value, scaled_lr, peak, scaled_lr,
    )
    if cfg.get("name") == "composite":
        node_ratio = global_batch_size / max(1, int(num_nodes)) / float(base_bs)
        node_lr = base_value * (math.sqrt(node_ratio) if scaling_type == "sqrt" else node_ratio)
        cfg = _resolve_linear_warmup(cfg, node_lr, int(num_nodes), sched_key)
    return cfg


def _scale_as_vissl(cfg: Dict[str, Any], scaled_lr: float, factor: float) -> None:
    """In place: VISSL's auto-scaling rule for the schedule's type (composite: each child).

    A linear schedule is multiplied by ``factor`` (scaled_lr / the schedule's peak), which keeps
    its shape: a warm-up then ends at scaled_lr, as in VISSL, and its start is set by the warm-up
    rule of a composite (:func:`_resolve_linear_warmup`); a decay stays a decay (VISSL's rule,
    end_value = scaled_lr, would turn it into a rise). So is a schedule VISSL has no rule for
    (polynomial, one of your own: VISSL stops with an error) or whose rule cannot apply (a
    first value of 0).
    """
    name = str(cfg.get("name"))
    if name == "composite":
        for child in cfg.get("schedulers") or []:
            warm_up = child.get("name") == "linear" and _rises(child)
            _scale_as_vissl(child, scaled_lr, factor)
            if warm_up:  # VISSL: a composite's warm-up ends at the scaled lr, wherever it was written to end
                child["end_value"] = float(scaled_lr)
        return
    if name in ("multistep", "step"):
        values = [float(v) for v in cfg.get("values") or []]
        if values and values[0] > 0:
            gamma = round(values[1] / values[0], 6) if len(values) > 1 else 1.0
            cfg["values"] = [round(float(scaled_lr * gamma ** i), 8) for i in range(len(values))]
            return
    elif "cosine" in name:
        start, end = float(cfg.get("start_value", 0.0)), float(cfg.get("end_value", 0.0))
        if start > 0:
            cfg["start_value"], cfg["end_value"] = float(scaled_lr), float(scaled_lr * end / start)
            return
    elif name == "constant":
        cfg["value"] = float(scaled_lr)
        return
    elif name == "step_with_fixed_gamma":
        cfg["base_value"] = float(scaled_lr)
        return
    elif name == "inverse_sqrt":
        cfg["start_value"] = float(scaled_lr)
        return
    _multiply(cfg, factor)


#: the largest change VISSL's rounding of multistep values to 8 decimals makes (half a unit of the 8th)
_VISSL_ROUNDING = 5.01e-9


def _warn_reshaped(scaled: Mapping[str, Any], as_written: Mapping[str, Any], key: str) -> None:
    """One warning when VISSL's rule gave other values than scaling the written schedule would."""
    got, kept = _lr_values(scaled), _lr_values(as_written)
    # VISSL rounds multistep values to 8 decimals (1.5625e-05 -> 1.562e-05): that is not a reshape
    if len(got) == len(kept) and all(math.isclose(a, b, rel_tol=1e-5, abs_tol=_VISSL_ROUNDING) for a, b in zip(got, kept)):
        return
    logger.warning(
        "%s.auto_lr_scaling: VISSL's rule gives the lr values %s where scaling the schedule as written gives %s "
        "(multistep/step values become scaled_lr * gamma**i with gamma = values[1] / values[0]; each part of a "
        "composite starts at the scaled lr); to train with other values, write them with auto_scale: false",
        key, _short(got), _short(kept),
    )


def _short(values: List[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


def _resolve_linear_warmup(cfg: Dict[str, Any], node_lr: float, num_nodes: int, key: str = LR_KEY) -> Dict[str, Any]:
    """VISSL's rule for the linear warm-up of an auto-scaled composite schedule.

    Goyal et al.'s warm-up ramps from the lr of one node's batch to the lr of the global
    batch. So every rising ``linear`` child starts at ``node_lr`` (and ends at scaled_lr, set
    by the scaling); a falling one (a linear decay) keeps its scaled values, where VISSL would
    restart it at the node's lr. On one node the ramp would start where it ends, and the child is dropped;
    if one child is left it becomes the whole schedule (over all of training), otherwise
    the dropped child's share of ``lengths`` goes to the others in proportion. VISSL uses
    the linear per-node factor even with ``scaling_type: sqrt``, which turns the warm-up
    into a decay when the batch is above ``base_lr_batch_size``; here the per-node lr
    follows ``scaling_type`` like the global one. As in VISSL, a child is dropped only on
    one node and only when it would not rise (start at or below its end).
    """
    children = cfg.get("schedulers") or []
    drop = None
    for i, child in enumerate(children):
        if child.get("name") == "linear" and _rises(child):  # a linear decay (a schedule's tail) is no warm-up
            child["start_value"] = node_lr
            if num_nodes == 1 and node_lr <= float(child.get("end_value", 0.0)) * (1 + 1e-9):
                drop = i
    if drop is None:
        return cfg
    logger.info(
        "auto_lr_scaling: one node: the linear warm-up %s.schedulers[%d] would start at its end value "
        "(%.6g), so it is left out, as VISSL does", key, drop, node_lr,
    )
    children = [c for i, c in enumerate(children) if i != drop]
    if len(children) == 1:
        kept = {k: cfg[k] for k in ("update_interval", "auto_lr_scaling") if k in cfg}
        return {**children[0], **kept}
    out = dict(cfg, schedulers=children)
    lengths = list(cfg.get("lengths") or [])
    if len(lengths) == len(children) + 1:
        rest = [float(v) for i, v in enumerate(lengths) if i != drop]
        out["lengths"] = [v / sum(rest) for v in rest] if sum(rest) > 0 else rest
    scaling = list(cfg.get("interval_scaling") or [])
    if len(scaling) == len(children) + 1:
        out["interval_scaling"] = [v for i, v in enumerate(scaling) if i != drop]
    return out


def _rises(child: Mapping[str, Any]) -> bool:
    try:
        return float(child.get("start_value", 0.0)) < float(child.get("end_value", 0.0))
    except (TypeError, ValueError):
        return False  # the schedule's own validation names the bad value


def _plain(cfg: Any) -> Any:
    """A deep plain-dict/list copy, so scaling never mutates the caller's config."""
    if isinstance(cfg, Mapping):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [_plain(v) for v in cfg]
    return copy.deepcopy(cfg)


def build_lr_scheduler(
    lr_cfg: Mapping[str, Any], num_epochs: int, global_batch_size: int, num_nodes: int = 1, key: str = LR_KEY
) -> Tuple[ParamScheduler, str]:
    """The (auto-scaled) lr schedule at config path ``key`` and its update interval ('step' or 'epoch')."""
    interval = lr_cfg.get("update_interval", "epoch")
    if interval not in UPDATE_INTERVALS:
        raise UserError(f"{key}.update_interval={interval!r} is not valid; use one of {', '.join(UPDATE_INTERVALS)}")
    _check_children(lr_cfg, key)  # before scaling, which reads every child
    scaled = scale_lr_schedule(lr_cfg, global_batch_size, num_nodes, key)
    scheduler = build_param_scheduler(scaled, num_epochs, key)
    _warn_unread_keys(lr_cfg, key)
    _check_no_negative_lr(scheduler, key)
    return scheduler, interval


#: the keys each built-in schedule reads, beside name, update_interval and auto_lr_scaling
_READS: Dict[str, Tuple[str, ...]] = {
    "constant": ("value",),
    "step": ("values",),
    "multistep": ("values", "milestones"),
    "linear": ("start_value", "end_value"),
    "cosine": ("start_value", "end_value"),
    "cosine_warm_restart": ("start_value", "end_value", "restart_interval_length", "wave_type", "lr_multiplier",
                            "is_adaptive"),
    "composite": ("schedulers", "interval_scaling", "lengths"),
    "step_with_fixed_gamma": ("base_value", "gamma", "num_decays"),
    "polynomial": ("base_value", "power"),
    "inverse_sqrt": ("start_value", "warmup_interval_length"),
}


def _warn_unread_keys(lr_cfg: Mapping[str, Any], key: str) -> None:
    """One warning naming the schedule options set away from their defaults that the chosen
    schedule does not read (``value: 0.5`` next to ``name: cosine``): VISSL ignores them as
    well, so a run would silently train with another lr than the one written."""
    reads = _READS.get(str(lr_cfg.get("name")))
    if reads is None:
        return
    from ssl_engine import distributed as du
    from ssl_engine.config.compose import load_defaults

    defaults = load_defaults()["config"]["OPTIMIZER"]["param_schedulers"]["lr"]
    options = {k for schedule_keys in _READS.values() for k in schedule_keys}
    unread = sorted(k for k in options - set(reads) if k in lr_cfg and k in defaults and lr_cfg[k] != defaults[k])
    if unread and du.is_primary():
        logger.warning("%s: %s %s not read by the %r schedule (it reads %s)", key, ", ".join(unread),
                       "is" if len(unread) == 1 else "are", lr_cfg.get("name"), ", ".join(reads))


def _check_no_negative_lr(scheduler: ParamScheduler, key: str, points: int = 1000) -> None:
    """A UserError when the schedule gives a negative lr anywhere (read at ``points`` places
    over training): SGD would then climb the loss, and torch's own check of the optimizer's
    lr never sees the scheduled values."""
    for i in range(points):
        where = i / points
        value = float(scheduler(where))
        if value < 0:
            raise UserError(f"{key} gives the learning rate {value:g} at {100 * where:g}% of training; "
                            f"a learning rate must be >= 0")
