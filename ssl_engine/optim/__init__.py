"""Optimizers (OPTIMIZERS registry, ``config.OPTIMIZER.name``), lr schedules and LARC.

Users add an optimizer with::

    @OPTIMIZERS.register("my_opt")
    def my_opt(param_groups, optimizer_cfg) -> torch.optim.Optimizer: ...

Param groups arrive with their weight_decay set; the lr schedule sets lr. Registered here:
sgd, adam, adamw, rmsprop (optimizer.py) and lars (lars.py).
"""

from ssl_engine.optim.larc import apply_larc_, parse_larc_config
from ssl_engine.optim.lars import LARS
from ssl_engine.optim.optimizer import SSLOptimizer, build_optimizer, get_param_groups
from ssl_engine.optim.schedulers import (
    build_lr_scheduler,
    build_param_scheduler,
    scale_lr_schedule,
    scheduler_names,
)

__all__ = [
    "apply_larc_",
    "build_lr_scheduler",
    "build_optimizer",
    "build_param_scheduler",
    "get_param_groups",
    "LARS",
    "parse_larc_config",
    "scale_lr_schedule",
    "scheduler_names",
    "SSLOptimizer",
]
