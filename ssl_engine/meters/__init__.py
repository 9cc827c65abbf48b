"""Meters, found by name through the METERS registry (``config.METERS.names``).

Every meter is a classy_vision ``ClassyMeter``: ``update(model_output, target)``,
``value``, ``sync_state()`` (all-reduce across ranks), ``reset()`` and
``get_classy_state`` / ``set_classy_state`` for exact resume.
"""

from typing import Any, List

from classy_vision.meters import ClassyMeter

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.meters.topk_list_meter import (
    AccuracyListMeter,
    PrecisionAtKListMeter,
    RecallAtKListMeter,
    TopKListMeter,
)
from ssl_engine.registry import METERS, build_from_config, part_origin


def meter_names(meters_config: AttrDict) -> List[str]:
    """The meter names a config asks for: ``METERS.names`` if set, else ``METERS.name`` ('' = none)."""
    names = meters_config.get("names") or []
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)):
        raise UserError(f"config.METERS.names={names!r} must be a list of meter names")
    if not names:
        single = meters_config.get("name") or ""
        names = [single] if single else []
    return [str(n) for n in names]


def build_meters(meters_config: AttrDict) -> List[ClassyMeter]:
    """One meter per name in ``config.METERS``, each built from ``config.METERS[name]``."""
    meters = []
    for name in meter_names(meters_config):
        meter_cls = METERS.get(name)
        sub = meters_config.get(name) or {}
        options = sub if isinstance(sub, AttrDict) else AttrDict(sub)
        meter = build_from_config("meter", name, f"config.METERS.{name}", meter_cls, options)
        check_meter_methods(meter, name)
        meters.append(meter)
    return meters


# what the engine reads of a meter: each must be the meter's own (ClassyMeter's raise NotImplementedError)
METER_ATTRIBUTES = ("update", "reset", "value", "name", "sync_state", "get_classy_state", "set_classy_state")


def check_meter_methods(meter: Any, name: str) -> None:
    """A meter of the user's that lacks what the engine calls (or leaves ClassyMeter's
    NotImplementedError in place) is a UserError naming it and what it lacks, before any phase
    has run, not an AttributeError at the end of the first phase. ``sync_state`` may be
    ClassyMeter's (it does nothing: the meter then reports each rank's own values)."""
    import inspect

    missing = []
    for attr in METER_ATTRIBUTES:
        found = inspect.getattr_static(meter, attr, None)
        if found is None:
            missing.append(attr)
        elif attr != "sync_state" and found is ClassyMeter.__dict__.get(attr):
            missing.append(attr)
    if missing:
        raise UserError(
            f"meter {name!r} (config.METERS.names) {part_origin(type(meter))} lacks {', '.join(missing)}; a meter "
            f"has update(model_output, target), reset(), the properties value and name, sync_state(), "
            f"get_classy_state() and set_classy_state(state) (subclass classy_vision's ClassyMeter)"
        )


def check_meters_fit_model(meters: List[ClassyMeter], model: Any) -> None:
    """Before launch: each meter with a ``check_outputs(sizes)`` (the top-k meters) is given the
    model's output sizes (``model.output_sizes()``, from the config, no forward), and raises the
    UserError its first ``update`` would raise (num_meters against the number of outputs, top-k
    against the classes). Nothing is checked when the model cannot say how many outputs it has."""
    output_sizes = getattr(model, "output_sizes", None)
    sizes = output_sizes() if callable(output_sizes) else None
    if sizes is None:
        return
    for meter in meters:
        check = getattr(meter, "check_outputs", None)
        if callable(check):
            check(sizes)


__all__ = [
    "AccuracyListMeter",
    "build_meters",
    "check_meters_fit_model",
    "ClassyMeter",
    "meter_names",
    "PrecisionAtKListMeter",
    "RecallAtKListMeter",
    "TopKListMeter",
]
