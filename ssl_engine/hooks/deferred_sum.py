"""DeferredSum: a running (weighted) sum of per-step 0-d tensors, read back only when asked.

Hooks that average the loss over a phase or a logging window would otherwise do tensor
arithmetic, or a device-to-host read, on every step. Adding here is a list append; the
tensors are combined in one stacked op when read, and folded into a single device tensor
every ``FOLD_EVERY`` additions so a long phase does not keep thousands of them alive.
"""

from typing import List, Optional

import torch


class DeferredSum:
    """``sum(w_i * x_i)`` and ``sum(w_i)`` over the added values, in float64."""

    FOLD_EVERY = 1024

    def __init__(self) -> None:
        self._values: List[torch.Tensor] = []
        self._weights: List[float] = []
        self._folded: Optional[torch.Tensor] = None  # on the values' device, no host read
        self._carry = 0.0  # a total restored from a checkpoint (see restore), on the host
        self.weight = 0.0

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: torch.Tensor, weight: float = 1.0) -> None:
        """Add ``weight * value`` (``value`` a 0-d or one-element tensor, on any device; it is not
        detached here: pass a detached tensor, e.g. ``task.last_loss``)."""
        self._values.append(value if value.ndim == 0 else value.reshape(()))
        self._weights.append(float(weight))
        self.weight += float(weight)
        if len(self._values) >= self.FOLD_EVERY:
            self._folded = self._device_total()
            self._values, self._weights = [], []

    def _device_total(self) -> Optional[torch.Tensor]:
        if not self._values:
            return self._folded
        values = torch.stack(self._values).detach().double()
        weights = torch.tensor(self._weights, dtype=torch.float64).to(values.device, non_blocking=True)
        total = torch.dot(values, weights)
        return total if self._folded is None else self._folded + total

    def total(self) -> float:
        """The weighted sum so far (one host read); 0.0 when nothing was added."""
        if self._values and self._folded is None and self._values[0].device.type == "cpu":
            # nothing to wait for on the CPU: reading each value beats building tensors to combine
            # them; added left to right from the carry, so a total restored mid-way and continued
            # equals the uninterrupted one bit for bit
            total = self._carry
            for v, w in zip(self._values, self._weights):
                total += float(v) * w
            return total
        t = self._device_total()
        return self._carry + (0.0 if t is None else float(t.item()))

    def mean(self) -> float:
        """Weighted mean, NaN when nothing was added."""
        return self.total() / self.weight if self.weight else float("nan")

    def clear(self) -> None:
        self._values, self._weights, self._folded, self.weight = [], [], None, 0.0
        self._carry = 0.0

    def restore(self, total: float, weight: float) -> None:
        """Start again from a ``total`` and ``weight`` read earlier (a checkpoint's)."""
        self.clear()
        self._carry, self.weight = float(total), float(weight)
