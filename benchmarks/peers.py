"""Other trainers on the same workload: classy_vision's LocalTrainer (installed with the engine),
PyTorch Ignite and PyTorch Lightning (installed by the project's ``bench`` extra, which
``make bench`` installs; each runner returns ``None`` when its package is missing).

Each is written the way its documentation shows a classification loop: the same model, data
(``DataLoader(TensorDataset)``), SGD, cross entropy, top-1 accuracy on every batch of train and
test phases, a test pass after every epoch, no checkpoints, logging or progress bars. Each
records the end of every iteration as ``(phase_idx, train, perf_counter())``, with train phase
``2 * epoch`` and its test phase ``2 * epoch + 1``, like the engine's step clock, into the
``steps`` list it is given (a paired run's, see common.run_paired) or a new one.
"""

import importlib.util
import logging
import tempfile
import warnings

import time
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from benchmarks import plain
from benchmarks.common import Step


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


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
    steps: Optional[List[Step]] = None,
) -> Dict[str, Any]:
    """Train ``model`` with classy_vision's ClassificationTask + LocalTrainer, a test phase per epoch.

    ``train`` / ``test`` are (x, y) tensors. Returns the end-of-iteration timestamps
    ``[(phase_idx, train, t)]`` (appended to ``steps`` when given) and the wall time of
    ``LocalTrainer.train``.
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

    steps = [] if steps is None else steps

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


def ignite_train(
    model: torch.nn.Module, train: Any, test: Any, batch_size: int, epochs: int, lr: float = 0.1,
    steps: Optional[List[Step]] = None,
) -> Optional[Dict[str, Any]]:
    """Ignite's ``create_supervised_trainer`` / ``create_supervised_evaluator`` with an Accuracy
    metric on both; ``None`` when pytorch-ignite is not installed."""
    if not installed("ignite"):
        return None
    from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
    from ignite.metrics import Accuracy, Loss

    steps = [] if steps is None else steps
    train_loader = plain.tensor_loader(*train, batch_size, shuffle=True)
    test_loader = plain.tensor_loader(*test, batch_size, shuffle=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    trainer = create_supervised_trainer(
        model, opt, F.cross_entropy, output_transform=lambda x, y, y_pred, loss: (y_pred.detach(), y)
    )
    Accuracy().attach(trainer, "accuracy")
    evaluator = create_supervised_evaluator(model, metrics={"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)})

    @trainer.on(Events.ITERATION_COMPLETED)
    def _train_clock(engine: Any) -> None:
        steps.append((2 * (engine.state.epoch - 1), True, time.perf_counter()))

    @evaluator.on(Events.ITERATION_COMPLETED)
    def _test_clock(engine: Any) -> None:
        steps.append((2 * (trainer.state.epoch - 1) + 1, False, time.perf_counter()))

    @trainer.on(Events.EPOCH_COMPLETED)
    def _test(engine: Any) -> None:
        evaluator.run(test_loader)

    t0 = time.perf_counter()
    trainer.run(train_loader, max_epochs=epochs)
    return {"steps": steps, "seconds": time.perf_counter() - t0}


def lightning_train(
    model: torch.nn.Module, train: Any, test: Any, batch_size: int, epochs: int, lr: float = 0.1,
    steps: Optional[List[Step]] = None,
) -> Optional[Dict[str, Any]]:
    """A ``LightningModule`` (loss and torchmetrics accuracy per batch, logged per epoch) and a
    CPU ``Trainer`` with a validation pass every epoch; ``None`` when lightning is not installed."""
    if not installed("lightning"):
        return None
    import lightning as L
    from torchmetrics.classification import MulticlassAccuracy

    steps = [] if steps is None else steps
    num_classes = int(max(int(train[1].max()), int(test[1].max())) + 1)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
            self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self.net(x)
            loss = F.cross_entropy(out, y)
            self.train_acc.update(out.detach(), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            out = self.net(x)
            self.val_acc.update(out, y)
            self.log("val_loss", F.cross_entropy(out, y), on_step=False, on_epoch=True)

        def on_train_epoch_end(self) -> None:
            self.log("train_acc", self.train_acc.compute())
            self.train_acc.reset()

        def on_validation_epoch_end(self) -> None:
            self.log("val_acc", self.val_acc.compute())
            self.val_acc.reset()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.0)

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            steps.append((2 * trainer.current_epoch, True, time.perf_counter()))

        def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            steps.append((2 * trainer.current_epoch + 1, False, time.perf_counter()))

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its banner lines about accelerators and tips
    with tempfile.TemporaryDirectory(prefix="bench_lightning_") as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its advice on num_workers and logging
        trainer = L.Trainer(
            max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            default_root_dir=root, callbacks=[Clock()],
        )
        t0 = time.perf_counter()
        trainer.fit(Module(), plain.tensor_loader(*train, batch_size, shuffle=True),
                    plain.tensor_loader(*test, batch_size, shuffle=False))
        seconds = time.perf_counter() - t0
    return {"steps": steps, "seconds": seconds}
