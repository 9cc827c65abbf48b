"""Train steps: one iteration of forward, loss, meters, backward and update.

A train step is a function ``step(task) -> None`` registered in TRAIN_STEPS and chosen by
config.TRAINER.TRAIN_STEP_NAME; it raises StopIteration when the phase's data runs out.
"""

from ssl_engine.registry import TRAIN_STEPS
from ssl_engine.train_steps.standard_train_step import standard_train_step

__all__ = ["TRAIN_STEPS", "standard_train_step"]
