"""Tasks: the object that holds a run's model, loss, meters, optimizer, data and phases."""

from ssl_engine.tasks.self_supervision_task import SelfSupervisionTask, build_task

__all__ = ["SelfSupervisionTask", "build_task"]
