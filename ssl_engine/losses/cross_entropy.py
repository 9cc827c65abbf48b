"""Cross-entropy losses for supervised training and linear evaluation.

``cross_entropy_multiple_output_single_target`` scores several heads (for example one
linear classifier per trunk layer in a benchmark) against the same labels and sums the
losses, so one backward pass trains all heads. ``CrossEntropyLoss`` is VISSL's default
loss name: plain cross-entropy of a single head.
"""

import math
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from classy_vision.losses import ClassyLoss

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.registry import LOSSES

Outputs = Union[torch.Tensor, Sequence[torch.Tensor]]
Target = Union[torch.Tensor, Sequence[torch.Tensor]]

_REDUCTIONS = ("mean", "sum")


def as_output_list(output: Outputs) -> List[torch.Tensor]:
    """The model output as a list of head outputs (a bare tensor is one head)."""
    if isinstance(output, torch.Tensor):
        return [output]
    outputs = list(output)
    for o in outputs:  # a loop, not all(<generator>): this runs on every step
        if not isinstance(o, torch.Tensor):
            break
    else:
        if outputs:
            return outputs
    raise TypeError(f"loss expects a tensor or a non-empty list of tensors, got {type(output).__name__}")


def as_class_target(target: Target) -> torch.Tensor:
    """Integer class labels of shape (B,) from a tensor, a (B, 1) tensor or a one-item list."""
    if not isinstance(target, torch.Tensor):
        items = list(target)
        if not items:
            raise UserError(
                "the loss scores class labels but the batch has none: set config.DATA.<split>.LABEL_SOURCES "
                "(e.g. [disk_folder] for class folders) or use a loss that needs no labels"
            )
        if len(items) != 1:
            raise ValueError(f"expected one target tensor, got a list of {len(items)}")
        target = items[0]
    if target.ndim == 2 and target.shape[1] == 1:
        target = target[:, 0]
    if target.ndim != 1:
        raise ValueError(f"expected class-index targets of shape (B,), got shape {tuple(target.shape)}")
    return target if target.dtype == torch.int64 else target.long()


def _check_reduction(reduction: str, key: str) -> str:
    if reduction == "none":  # F.cross_entropy's per-sample losses: backward needs one number
        raise UserError(f"{key}='none' gives one loss per sample, but training needs one number to "
                        f"minimise; use mean (the default) or sum")
    if reduction not in _REDUCTIONS:
        raise UserError(f"{key}={reduction!r} is not a valid reduction; use one of {', '.join(_REDUCTIONS)}")
    return reduction


def _class_weights(weight: Any, key: str) -> torch.Tensor:
    """``weight`` as a float tensor of per-class weights; a UserError naming ``key`` unless it is a
    list of finite numbers >= 0. A yaml string (``"1,2"``), a mapping, a number or a nested list
    ended the run in each rank with a torch traceback (or at the first step); a negative weight
    would train that class away from its label."""
    fix = "give a list of one number >= 0 per class (e.g. [1.0, 2.0, ...]), or null for equal weights"
    if not isinstance(weight, (list, tuple)):
        raise UserError(f"{key}={weight!r} is not a list: {fix}")
    values = []
    for i, w in enumerate(weight):
        number = None
        if isinstance(w, (int, float)) and not isinstance(w, bool):
            number = float(w)
        elif isinstance(w, str):  # yaml reads 1e-5 (no dot) as a string
            try:
                number = float(w)
            except ValueError:
                pass
        if number is None or not math.isfinite(number) or number < 0:
            raise UserError(f"{key}[{i}]={w!r} is not a finite number >= 0: {fix}")
        values.append(number)
    return torch.as_tensor(values, dtype=torch.float32)


@LOSSES.register("cross_entropy_multiple_output_single_target")
class CrossEntropyMultipleOutputSingleTargetLoss(ClassyLoss):
    """Sum over heads of cross-entropy(head output, target).

    Args:
        weight: optional per-class weights (kept as a buffer so it follows ``.to(device)``).
        reduction: 'mean' | 'sum', per head, as in ``F.cross_entropy`` ('none' is refused: it is not one number).
        ignore_index: label value that contributes no loss.
        normalize_output: L2-normalise each output row before the temperature (cosine
            classifier logits).
        temperature: logits are divided by it.
    """

    CONFIG_KEY = "config.LOSS.cross_entropy_multiple_output_single_target"
    needs_labels = True  # scores class labels: the data must give them (checked before launch)
    class_index_targets = True  # a label indexes each head output's classes (models/label_range.py)
    per_row_loss = True  # each row's loss is its own: padded rows can be left out (standard_train_step)

    def __init__(
        self,
        weight: Optional[Sequence[float]] = None,
        reduction: str = "mean",
        ignore_index: int = -1,
        normalize_output: bool = False,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction, f"{self.CONFIG_KEY}.reduction")
        if not temperature > 0:
            raise UserError(f"{self.CONFIG_KEY}.temperature={temperature!r} must be > 0")
        self.ignore_index = int(ignore_index)
        self.normalize_output = bool(normalize_output)
        self.temperature = float(temperature)
        self.weight: Optional[torch.Tensor]
        if weight is None:
            self.weight = None
        else:
            self.register_buffer("weight", _class_weights(weight, f"{self.CONFIG_KEY}.weight"))

    def _check_weight(self, classes: int) -> None:
        if self.weight is not None and self.weight.numel() != classes:
            raise UserError(
                f"{self.CONFIG_KEY}.weight has {self.weight.numel()} entries but the head scores {classes} "
                f"classes: give one weight per class, or null for equal weights"
            )

    def check_model(self, model: torch.nn.Module) -> None:
        """Before launch: ``weight`` has one entry per class of each head the config sizes."""
        output_sizes = getattr(model, "output_sizes", None)
        for size in (output_sizes() if callable(output_sizes) else None) or []:
            if size is not None:
                self._check_weight(size)

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "CrossEntropyMultipleOutputSingleTargetLoss":
        """Build from ``config.LOSS.cross_entropy_multiple_output_single_target``."""
        cfg = loss_config or {}
        return cls(
            weight=cfg.get("weight", None),
            reduction=cfg.get("reduction", "mean"),
            ignore_index=cfg.get("ignore_index", -1),
            normalize_output=cfg.get("normalize_output", False),
            temperature=cfg.get("temperature", 1.0),
        )

    def forward(self, output: Outputs, target: Target) -> torch.Tensor:
        """Summed cross-entropy of every head output against the one target."""
        target = as_class_target(target)
        total: Any = None
        for logits in as_output_list(output):
            if logits.dtype != torch.float32:
                logits = logits.float()  # bf16/fp16 logits: log-softmax in float32
            if self.normalize_output:
                logits = F.normalize(logits, dim=1, p=2)
            if self.temperature != 1.0:
                logits = logits / self.temperature
            weight = None
            if self.weight is not None:
                self._check_weight(int(logits.shape[1] if logits.ndim > 1 else logits.shape[0]))
                weight = self.weight.to(logits.device)
            loss = F.cross_entropy(logits, target, weight=weight, ignore_index=self.ignore_index, reduction=self.reduction)
            total = loss if total is None else total + loss
        return total


@LOSSES.register("CrossEntropyLoss")
class CrossEntropyLoss(ClassyLoss):
    """Cross-entropy of a single head output (VISSL's default ``LOSS.name``)."""

    CONFIG_KEY = "config.LOSS.CrossEntropyLoss"
    needs_labels = True
    class_index_targets = True
    per_row_loss = True

    def __init__(self, ignore_index: int = -1) -> None:
        super().__init__()
        self.ignore_index = int(ignore_index)

    @classmethod
    def from_config(cls, loss_config: AttrDict) -> "CrossEntropyLoss":
        """Build from ``config.LOSS.CrossEntropyLoss``."""
        cfg = loss_config or {}
        return cls(ignore_index=cfg.get("ignore_index", -1))

    def forward(self, output: Outputs, target: Target) -> torch.Tensor:
        """Mean cross-entropy; the model must have exactly one head output."""
        outputs = as_output_list(output)
        if len(outputs) != 1:
            raise UserError(
                f"config.LOSS.name='CrossEntropyLoss' scores one head but the model returned "
                f"{len(outputs)} outputs; use config.LOSS.name=cross_entropy_multiple_output_single_target"
            )
        return F.cross_entropy(outputs[0].float(), as_class_target(target), ignore_index=self.ignore_index)
