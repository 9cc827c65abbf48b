"""Hooks: one concern per file; default_hooks(cfg) builds the list a run uses."""

from pathlib import Path
from typing import Any, List

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.hooks.base import EVENTS, Priority, SSLHook, order_hooks, parse_priority
from ssl_engine.hooks.checkpoint_hook import CheckpointHook
from ssl_engine.hooks.metrics_hook import MetricsHook
from ssl_engine.hooks.periodic_writer import ConsoleWriter, JsonLinesWriter, PeriodicWriterHook
from ssl_engine.registry import HOOKS


def custom_hooks(cfg: AttrDict) -> List[Any]:
    """HOOKS.CUSTOM: registered hooks named in yaml, with an optional priority and params."""
    out = []
    for entry in cfg.HOOKS.CUSTOM:
        cls = HOOKS.get(entry["name"])
        params = dict(entry.get("params") or {})
        try:
            hook = cls(**params)
        except TypeError as e:
            from ssl_engine.errors import UserError

            raise UserError(f"config.HOOKS.CUSTOM hook {entry['name']!r}: bad params {params}: {e}") from None
        if "priority" in entry and entry["priority"] is not None:
            hook.priority = parse_priority(entry["priority"])
        out.append(hook)
    return out


def default_hooks(cfg: AttrDict) -> List[Any]:
    """The hooks a training run uses, from the config."""
    folder = Path(cfg.CHECKPOINT.DIR)
    hooks: List[Any] = [
        PeriodicWriterHook(cfg.LOG_FREQUENCY, [ConsoleWriter(), JsonLinesWriter(folder / "stdout.json")]),
        MetricsHook(str(folder)),
        CheckpointHook(cfg.CHECKPOINT.CHECKPOINT_FREQUENCY, cfg.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY),
    ]
    hooks += custom_hooks(cfg)
    return order_hooks(hooks)


__all__ = [
    "EVENTS", "Priority", "SSLHook", "order_hooks", "parse_priority", "default_hooks", "custom_hooks",
    "CheckpointHook", "MetricsHook", "PeriodicWriterHook",
]
