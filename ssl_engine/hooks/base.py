"""The hook base class, priorities and the events a hook can use.

Hooks are classy_vision ClassyHooks with every event a no-op by default, a ``priority``
(lower runs first; ties run in registration order), and state carried through
get/set_classy_state so that it survives a resume.
"""

from enum import IntEnum
from typing import Any, Dict, List, Union

from classy_vision.hooks.classy_hook import ClassyHook

EVENTS = (
    "on_start",
    "on_phase_start",
    "on_forward",
    "on_loss_and_meter",
    "on_backward",
    "on_update",
    "on_step",
    "on_phase_end",
    "on_end",
    "on_exception",
)


class Priority(IntEnum):
    """Named priorities, as detectron2/mmcv users know them: lower values run first."""

    VERY_HIGH = 10
    HIGH = 30
    ABOVE_NORMAL = 40
    NORMAL = 50
    BELOW_NORMAL = 60
    LOW = 70
    VERY_LOW = 90


def parse_priority(value: Union[str, int, "Priority"], key: str = "hook priority") -> int:
    """A priority name (any case) or an int 0-100 (``key``: where the value was given, for the error)."""
    if isinstance(value, str):
        try:
            return int(Priority[value.upper()])
        except KeyError:
            from ssl_engine.errors import UserError

            raise UserError(
                f"{key}={value!r} is not valid: use one of {', '.join(p.name for p in Priority)} or an int 0-100"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= int(value) <= 100:
        from ssl_engine.errors import UserError

        raise UserError(f"{key}={value!r} is not valid: use a priority name or an int 0-100")
    return int(value)


class SSLHook(ClassyHook):
    """Base of every ssl_engine hook: override only the events you need.

    ``rank_local_state = True`` marks a hook whose classy state differs between ranks (sums
    over a rank's own batches): a checkpoint then keeps every rank's state and each rank gets
    its own back on resume. Otherwise rank 0's state is saved and given to every rank.
    """

    priority: int = Priority.NORMAL
    rank_local_state: bool = False

    def on_start(self, task: Any) -> None:
        pass

    def on_phase_start(self, task: Any) -> None:
        pass

    def on_forward(self, task: Any) -> None:
        pass

    def on_loss_and_meter(self, task: Any) -> None:
        pass

    def on_backward(self, task: Any) -> None:
        pass

    def on_update(self, task: Any) -> None:
        pass

    def on_step(self, task: Any) -> None:
        pass

    def on_phase_end(self, task: Any) -> None:
        pass

    def on_end(self, task: Any) -> None:
        pass

    def on_exception(self, task: Any) -> None:
        pass

    def events_used(self) -> List[str]:
        """The events this hook overrides (so the task calls only those)."""
        used = []
        for ev in EVENTS:
            fn = getattr(type(self), ev, None)
            base = getattr(SSLHook, ev)
            if fn is not None and fn is not base:
                used.append(ev)
        return used

    def get_classy_state(self) -> Dict[str, Any]:
        return self.state.get_classy_state()

    def set_classy_state(self, state_dict: Dict[str, Any]) -> None:
        self.state.set_classy_state(state_dict)


def order_hooks(hooks: List[ClassyHook]) -> List[ClassyHook]:
    """Hooks sorted by priority; ties keep registration order."""
    return [h for _, _, h in sorted((getattr(h, "priority", Priority.NORMAL), i, h) for i, h in enumerate(hooks))]
