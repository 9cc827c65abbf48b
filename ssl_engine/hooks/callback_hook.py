"""CallbackHook: user callables for any event, without writing a hook class.

In python::

    CallbackHook(on_step=lambda task: ..., on_phase_end=my_fn)

From yaml (HOOKS.CUSTOM), callables are named as ``"package.module:function"`` (or
``"package.module.function"``); the module is imported when the hook is built::

    HOOKS:
      CUSTOM: [{name: CallbackHook, priority: HIGH, params: {on_phase_end: "my_pkg.cb:report"}}]

Each callable receives the task. Only the events given are called.
"""

import importlib
from typing import Any, Callable, Dict, List, Optional, Union

from ssl_engine.errors import UserError
from ssl_engine.hooks.base import EVENTS, SSLHook, parse_priority
from ssl_engine.registry import HOOKS

Callback = Callable[[Any], None]


def resolve_callable(spec: Union[str, Callable], what: str) -> Callable:
    """A callable, or one named "module:attr" / "module.attr" (imported now)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise UserError(f"{what}: {spec!r} is not a callable nor a 'module:function' name")
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"{what}: {spec!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{what}: cannot import module {module_name!r} of {spec!r}: {e}") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserError(f"{what}: module {module_name!r} has no {attr!r} (from {spec!r})")
    if not callable(fn):
        raise UserError(f"{what}: {spec!r} is not callable")
    return fn


@HOOKS.register("CallbackHook")
class CallbackHook(SSLHook):
    """Calls the given callables at their events; the other events are not called at all."""

    def __init__(self, priority: Optional[Union[int, str]] = None, **callbacks: Union[str, Callback]) -> None:
        super().__init__()
        unknown = [k for k in callbacks if k not in EVENTS]
        if unknown:
            raise UserError(f"CallbackHook: unknown event {', '.join(unknown)}; events are {', '.join(EVENTS)}")
        self._callbacks: Dict[str, Callback] = {
            ev: resolve_callable(fn, f"CallbackHook {ev}") for ev, fn in callbacks.items() if fn is not None
        }
        if priority is not None:
            self.priority = parse_priority(priority)

    def events_used(self) -> List[str]:
        return [ev for ev in EVENTS if ev in self._callbacks]

    def _call(self, event: str, task: Any) -> None:
        fn = self._callbacks.get(event)
        if fn is not None:
            fn(task)

    def on_start(self, task: Any) -> None:
        self._call("on_start", task)

    def on_phase_start(self, task: Any) -> None:
        self._call("on_phase_start", task)

    def on_forward(self, task: Any) -> None:
        self._call("on_forward", task)

    def on_loss_and_meter(self, task: Any) -> None:
        self._call("on_loss_and_meter", task)

    def on_backward(self, task: Any) -> None:
        self._call("on_backward", task)

    def on_update(self, task: Any) -> None:
        self._call("on_update", task)

    def on_step(self, task: Any) -> None:
        self._call("on_step", task)

    def on_phase_end(self, task: Any) -> None:
        self._call("on_phase_end", task)

    def on_end(self, task: Any) -> None:
        self._call("on_end", task)

    def on_exception(self, task: Any) -> None:
        self._call("on_exception", task)

    def get_classy_state(self) -> Dict[str, Any]:
        return {}

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        pass
