"""The reference: a hand-written PyTorch training loop, what a user writes without an engine.

Train epochs interleaved with no-grad test passes; top-1 accuracy and the loss summed on the
device and read once per phase (the work the engine's meter and MetricsHook do); SGD, optional
autocast + GradScaler. It records the same end-of-iteration
timestamps as the engine's StepClock.
"""

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks.common import Step


def tensor_loader(
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    shuffle: bool,
    workers: int = 0,
    seed: int = 0,
    pin_memory: bool = False,
    mp_context: Optional[str] = None,
) -> DataLoader:
    """``DataLoader(TensorDataset(x, y))``; persistent workers when there are workers."""
    return dataset_loader(TensorDataset(x, y), batch_size, shuffle, workers, seed, pin_memory, mp_context)


def dataset_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    workers: int = 0,
    seed: int = 0,
    pin_memory: bool = False,
    mp_context: Optional[str] = None,
) -> DataLoader:
    kwargs: Dict[str, Any] = {}
    if workers > 0:
        kwargs["persistent_workers"] = True
        if mp_context:
            kwargs["multiprocessing_context"] = mp_context
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )


def train_and_test(
    model: torch.nn.Module,
    train_loader: DataLoader,
    test_loader: Optional[DataLoader],
    epochs: int,
    lr: float = 0.1,
    momentum: float = 0.0,
    device: torch.device = torch.device("cpu"),
    amp_dtype: Optional[torch.dtype] = None,
    steps: Optional[List[Step]] = None,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
) -> Dict[str, Any]:
    """``epochs`` train epochs, each followed by a test pass over ``test_loader`` (when given).

    Returns (phase type, accuracy, loss sum) per phase and the loop's wall time; ``steps`` receives
    (phase_idx, train, perf_counter) at the end of every iteration.
    """
    steps = steps if steps is not None else []
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 and device.type == "cuda" else None
    non_blocking = device.type == "cuda"

    def autocast() -> Any:
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp_dtype)

    accuracies = []
    phase = -1
    t0 = time.perf_counter()
    for _ in range(epochs):
        phase += 1
        model.train()
        correct = torch.zeros((), dtype=torch.int64, device=device)
        loss_sum = torch.zeros((), device=device)
        seen = 0
        for x, y in train_loader:
            x = x.to(device, non_blocking=non_blocking)
            y = y.to(device, non_blocking=non_blocking)
            with autocast():
                out = model(x)
                loss = loss_fn(out.float(), y)
            correct += (out.detach().argmax(1) == y).sum()
            loss_sum += loss.detach()
            seen += len(y)
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            steps.append((phase, True, time.perf_counter()))
        accuracies.append(("train", float(correct.item()) / max(1, seen), float(loss_sum.item())))
        if test_loader is None:
            continue
        phase += 1
        model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=device)
        loss_sum = torch.zeros((), device=device)
        seen = 0
        with torch.no_grad():
            for x, y in test_loader:
                x = x.to(device, non_blocking=non_blocking)
                y = y.to(device, non_blocking=non_blocking)
                with autocast():
                    out = model(x)
                    loss_sum += loss_fn(out.float(), y)
                correct += (out.argmax(1) == y).sum()
                seen += len(y)
                steps.append((phase, False, time.perf_counter()))
        accuracies.append(("test", float(correct.item()) / max(1, seen), float(loss_sum.item())))
    return {"steps": steps, "seconds": time.perf_counter() - t0, "accuracies": accuracies}
