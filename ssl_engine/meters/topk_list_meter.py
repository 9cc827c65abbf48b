"""Top-k meters over a list of heads: accuracy, precision@k, recall@k.

A benchmark model often has one classifier per trunk layer (res4, res5, ...), so the
model output is a list of logits and each gets its own classy_vision meter. The value is
VISSL's layout, in percent::

    {"top_1": {"res4": 61.2, "res5": 71.2}, "top_5": {"res4": 83.0, "res5": 90.1}}

keyed by ``meter_names`` (or "0", "1", ... when no names are given).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from classy_vision.meters import AccuracyMeter, ClassyMeter, PrecisionAtKMeter, RecallAtKMeter

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.registry import METERS

ModelOutput = Union[torch.Tensor, Sequence[torch.Tensor]]
Target = Union[torch.Tensor, Sequence[torch.Tensor]]


class DeviceAccuracyMeter(AccuracyMeter):
    """classy_vision's AccuracyMeter with its counts kept on the outputs' device.

    classy's ``update`` reads each top-k count back to the host (``.item()``), one device sync
    per k per step. Here an update computes the batch's correct counts on the device and keeps
    them in a list; they are summed into the counts in one op only when ``value`` or the state
    is asked for (at phase end, when logging, when checkpointing), or every ``FOLD_EVERY``
    updates. The state has classy's layout (float32 CPU tensors), so the two are
    interchangeable in a checkpoint.
    """

    FOLD_EVERY = 1024

    def update(self, model_output: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> None:
        if self._top1 and target.ndim == 1:  # plain top-1 of class indices: no sort needed
            correct = (model_output.argmax(dim=1) == target).sum()
        else:
            correct = self._topk_correct(model_output, target)
        self._pending.append(correct)
        self._uncounted += model_output.shape[0]  # a host int, added to the count tensor when read
        if len(self._pending) >= self.FOLD_EVERY:
            self._count_samples()

    def _topk_correct(self, model_output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The batch's correct count for each k of ``topk`` (one-hot / multi-label rows, or class
        indices of shape [B] or [B, 1])."""
        multi_label = target.ndim == 2 and target.shape[1] == model_output.shape[1]
        if self._top1 and not multi_label:
            return (model_output.argmax(dim=1) == target.reshape(-1)).sum()
        _, pred = model_output.float().topk(max(self._topk), dim=1, largest=True, sorted=True)
        if multi_label:
            hits = torch.gather(target, dim=1, index=pred) > 0
        else:
            hits = pred == target.reshape(-1, 1)
        # correct@k = some hit among the first k predictions
        return torch.stack([hits[:, :k].any(dim=1).sum() for k in self._topk])

    def _count_samples(self) -> None:
        """Fold the pending per-batch counts into classy's count tensors."""
        if self._pending:
            pending, self._pending = self._pending, []
            correct = torch.stack([c.reshape(-1) for c in pending]).sum(dim=0)
            if self._curr_correct_predictions_k.device != correct.device:
                self._to(correct.device)
            self._curr_correct_predictions_k += correct
        if self._uncounted:
            self._curr_sample_count += self._uncounted
            self._uncounted = 0

    def sync_state(self) -> None:
        """Fold the pending counts and all-reduce them on the CPU. A GPU rank's group sends CUDA
        tensors over NCCL and CPU tensors over gloo, and a rank that saw no sample this phase
        (a test split smaller than the world) still holds its counts on the CPU: on their own
        devices the ranks would enter different collectives and wait for each other until the
        timeout. The counts move back to the outputs' device at the next update."""
        self._count_samples()
        self._to(torch.device("cpu"))
        super().sync_state()

    @property
    def value(self) -> Dict[str, float]:
        self._count_samples()
        return super().value

    def _to(self, device: torch.device) -> None:
        self._total_correct_predictions_k = self._total_correct_predictions_k.to(device)
        self._total_sample_count = self._total_sample_count.to(device)
        self._curr_correct_predictions_k = self._curr_correct_predictions_k.to(device)
        self._curr_sample_count = self._curr_sample_count.to(device)

    def get_classy_state(self) -> Dict[str, Any]:
        self._count_samples()
        return {key: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for key, v in super().get_classy_state().items()}

    def reset(self) -> None:
        current = getattr(self, "_curr_sample_count", None)  # None while classy's __init__ runs
        self._top1 = list(self._topk) == [1]
        self._pending: List[torch.Tensor] = []
        self._uncounted = 0
        super().reset()
        if isinstance(current, torch.Tensor) and current.device.type != "cpu":
            self._to(current.device)


class TopKListMeter(ClassyMeter):
    """``num_meters`` copies of one classy_vision top-k meter, one per model output.

    Subclasses set ``NAME`` (the registry / config name), ``INNER`` (the classy meter
    class) and ``ON_CPU`` (whether the classy meter only works on CPU tensors).
    """

    NAME = ""
    INNER: Type[ClassyMeter] = AccuracyMeter
    ON_CPU = False
    needs_labels = True  # scores against class labels: the data must give them (checked before launch)
    class_index_targets = True  # a label indexes each head output's classes (models/label_range.py)

    def __init__(self, num_meters: int = 1, topk_values: Sequence[int] = (1,), meter_names: Sequence[str] = ()) -> None:
        super().__init__()
        key = f"config.METERS.{self.NAME}"
        if not isinstance(num_meters, int) or num_meters < 1:
            raise UserError(f"{key}.num_meters={num_meters!r} must be a positive integer")
        topk = list(topk_values)
        if not topk or not all(isinstance(k, int) and k >= 1 for k in topk):
            raise UserError(f"{key}.topk_values={topk_values!r} must be a non-empty list of integers >= 1")
        names = [str(n) for n in meter_names]
        if names and len(names) != num_meters:
            raise UserError(
                f"{key}.meter_names has {len(names)} names but {key}.num_meters={num_meters}; "
                "give one name per meter or leave meter_names empty"
            )
        self.num_meters = num_meters
        self.topk_values = topk
        self._k_max = max(topk)
        self.meter_names = names or [str(i) for i in range(num_meters)]
        self._meters = [self.INNER(topk=list(topk)) for _ in range(num_meters)]
        self._outputs_checked = False

    @classmethod
    def from_config(cls, meters_config: AttrDict) -> "TopKListMeter":
        """Build from ``config.METERS[NAME]`` (num_meters, topk_values, meter_names)."""
        cfg = meters_config or {}
        return cls(
            num_meters=cfg.get("num_meters", 1),
            topk_values=cfg.get("topk_values", [1]),
            meter_names=cfg.get("meter_names", []) or [],
        )

    @property
    def name(self) -> str:
        return self.NAME

    def check_outputs(self, sizes: Sequence[Optional[int]]) -> None:
        """Raise a UserError naming the config key when this meter cannot score model outputs of
        these class counts: ``sizes`` has one entry per model output, its number of classes (the
        size of dim 1 of an [N, C] output), or None where that is unknown or the output is not
        [N, C]. The check of a phase's first :meth:`update` (and of any update with another number
        of outputs), and of the config before launch (with the
        class counts the heads' config gives, see ``SSLModel.output_sizes``)."""
        if len(sizes) != self.num_meters:
            n = len(sizes)
            raise UserError(
                f"config.METERS.{self.NAME}.num_meters={self.num_meters} but the model returns {n} "
                f"output{'' if n == 1 else 's'}; set num_meters to {n} (one meter per model output)"
            )
        for size in sizes:
            if size is not None and self._k_max > size:
                raise UserError(
                    f"config.METERS.{self.NAME}.topk_values={self.topk_values}: top-{self._k_max} needs at least "
                    f"{self._k_max} classes, but the model outputs {size}; use top-k values up to {size}"
                )

    def _pairs(self, model_output: ModelOutput, target: Target) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        outputs = [model_output] if isinstance(model_output, torch.Tensor) else list(model_output)
        if not self._outputs_checked or len(outputs) != self.num_meters:  # a model's class counts stay put
            self.check_outputs([int(out.shape[1]) if out.ndim == 2 else None for out in outputs])
            self._outputs_checked = True
        if isinstance(target, torch.Tensor):
            targets = [target] * len(outputs)
        else:
            targets = list(target)
            if len(targets) == 1:
                targets = targets * len(outputs)
            elif len(targets) != len(outputs):
                raise ValueError(f"{self.NAME}: {len(targets)} targets for {len(outputs)} outputs")
        pairs = []
        for out, tgt in zip(outputs, targets):
            if out.requires_grad:
                out = out.detach()
            if self.ON_CPU:
                out, tgt = out.cpu(), tgt.cpu()
            elif tgt.device != out.device:
                tgt = tgt.to(out.device)
            pairs.append((out, tgt))
        return pairs

    def update(self, model_output: ModelOutput, target: Target, **kwargs: Any) -> None:
        """Add one batch: one output per meter, the same target for all (or one target each)."""
        for meter, (out, tgt) in zip(self._meters, self._pairs(model_output, target)):
            meter.update(out, tgt)

    @property
    def value(self) -> Dict[str, Dict[str, float]]:
        """``{"top_k": {meter_name: percent}}`` over everything seen (synced + local)."""
        result: Dict[str, Dict[str, float]] = {f"top_{k}": {} for k in self.topk_values}
        for meter_name, meter in zip(self.meter_names, self._meters):
            for top_k, fraction in meter.value.items():
                result[top_k][meter_name] = round(100.0 * float(fraction), 6)
        return result

    def sync_state(self) -> None:
        """All-reduce the counts since the last sync across ranks (no-op on one process)."""
        for meter in self._meters:
            meter.sync_state()

    def reset(self) -> None:
        self._outputs_checked = False  # checked again at the first update of each phase
        for meter in self._meters:
            meter.reset()

    def validate(self, model_output_shape: Tuple, target_shape: Tuple) -> None:
        for meter in self._meters:
            meter.validate(model_output_shape, target_shape)

    def get_classy_state(self) -> Dict[str, Any]:
        """Counts of every inner meter; tensors and plain containers only."""
        return {
            "name": self.name,
            "num_meters": self.num_meters,
            "topk_values": list(self.topk_values),
            "meter_names": list(self.meter_names),
            "meters": [meter.get_classy_state() for meter in self._meters],
        }

    def set_classy_state(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`get_classy_state`; a different meter layout is a CheckpointError."""
        theirs = (state.get("name"), state.get("num_meters"), list(state.get("topk_values", [])))
        ours = (self.name, self.num_meters, list(self.topk_values))
        if theirs != ours:
            raise CheckpointError(
                f"checkpoint meter state (name, num_meters, topk_values)={theirs} does not match "
                f"config.METERS.{self.NAME}={ours}"
            )
        for meter, meter_state in zip(self._meters, state["meters"]):
            meter.set_classy_state(meter_state)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{top_k}={{{', '.join(f'{n}: {v:.4f}' for n, v in per_name.items())}}}"
            for top_k, per_name in self.value.items()
        )
        return f"{self.name}({parts})"


@METERS.register("accuracy_list_meter")
class AccuracyListMeter(TopKListMeter):
    """Top-k accuracy (percent of samples whose label is among the k best scores), per head."""

    NAME = "accuracy_list_meter"
    INNER = DeviceAccuracyMeter


@METERS.register("precision_at_k_list_meter")
class PrecisionAtKListMeter(TopKListMeter):
    """Precision@k (percent of the k predictions that are correct labels), per head."""

    NAME = "precision_at_k_list_meter"
    INNER = PrecisionAtKMeter
    ON_CPU = True  # classy_vision builds its prediction mask on the CPU


@METERS.register("recall_at_k_list_meter")
class RecallAtKListMeter(TopKListMeter):
    """Recall@k (percent of the true labels found among the k predictions), per head."""

    NAME = "recall_at_k_list_meter"
    INNER = RecallAtKMeter
    ON_CPU = True  # classy_vision builds its prediction mask on the CPU
