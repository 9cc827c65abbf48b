"""Train steps: one iteration of forward, loss, meters, backward and update.

A train step is a function ``step(task) -> None`` registered in TRAIN_STEPS and chosen by
config.TRAINER.TRAIN_STEP_NAME; it raises StopIteration when the phase's data runs out.
"""

from typing import Any, Callable

from ssl_engine.registry import TRAIN_STEPS, check_call
from ssl_engine.train_steps.standard_train_step import standard_train_step


def train_step_of(name: str) -> Callable[[Any], None]:
    """The train step registered as ``name``; one that cannot be called as ``step(task)`` (it
    takes other arguments) is a UserError naming it, before any step runs."""
    fn = TRAIN_STEPS.get(name)
    check_call(fn, (None,), name, f"train step {name!r} (config.TRAINER.TRAIN_STEP_NAME)", "called as {}(task)",
               "a train step takes the task alone")
    return fn


__all__ = ["TRAIN_STEPS", "standard_train_step", "train_step_of"]
