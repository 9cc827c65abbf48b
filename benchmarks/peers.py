"""Other trainers on the same workload: classy_vision's LocalTrainer (installed with the engine).

PyTorch Lightning and Ignite are not installed here and not dependencies of the project, so
there is no runner for them (see benchmarks/README.md).
"""

import time
from typing import Any, Dict, List

import torch
from torch.utils.data import Dataset

from benchmarks.common import Step


class DictSamples(Dataset):
    """classy_vision's sample format: ``{"input": x[i], "target": y[i]}``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input": self.x[i], "target": self.y[i]}


def classy_train(
    model: torch.nn.Module,
    train: Any,
    test: Any,
    batch_size: int,
    epochs: int,
    lr: float = 0.1,
) -> Dict[str, Any]:
    """Train ``model`` with classy_vision's ClassificationTask + LocalTrainer, a test phase per epoch.

    ``train`` / ``test`` are (x, y) tensors. Returns the end-of-iteration timestamps
    ``[(phase_idx, train, t)]`` and the wall time of ``LocalTrainer.train``.
    """
    from classy_vision.dataset import ClassyDataset
    from classy_vision.hooks import ClassyHook
    from classy_vision.losses import build_loss
    from classy_vision.meters import AccuracyMeter
    from classy_vision.models import ClassyModel
    from classy_vision.optim import SGD
    from classy_vision.optim.param_scheduler import ConstantParamScheduler
    from classy_vision.tasks import ClassificationTask
    from classy_vision.trainer import LocalTrainer

    steps: List[Step] = []

    class Clock(ClassyHook):
        on_start = ClassyHook._noop
        on_phase_start = ClassyHook._noop
        on_phase_end = ClassyHook._noop
        on_end = ClassyHook._noop

        def on_step(self, task: Any) -> None:
            steps.append((task.phase_idx, task.train, time.perf_counter()))

    def dataset(x: torch.Tensor, y: torch.Tensor, shuffle: bool) -> ClassyDataset:
        ds = ClassyDataset(DictSamples(x, y), batchsize_per_replica=batch_size, shuffle=shuffle, transform=None,
                           num_samples=None)
        ds.set_num_workers(0)
        return ds

    task = (
        ClassificationTask()
        .set_model(ClassyModel.from_model(model))
        .set_loss(build_loss({"name": "CrossEntropyLoss"}))
        .set_optimizer(SGD(lr=lr, momentum=0.0))
        .set_optimizer_schedulers({"lr": ConstantParamScheduler(lr)})
        .set_meters([AccuracyMeter(topk=[1])])
        .set_dataset(dataset(*train, True), "train")
        .set_dataset(dataset(*test, False), "test")
        .set_num_epochs(epochs)
        .set_hooks([Clock()])
        .set_use_gpu(False)
    )
    t0 = time.perf_counter()
    LocalTrainer().train(task)
    return {"steps": steps, "seconds": time.perf_counter() - t0}
