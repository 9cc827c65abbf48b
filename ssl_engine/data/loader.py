"""The DataLoader of one split: stateful sampler, collator, persistent workers.

The task builds one loader per split and, at each phase, calls::

    set_loader_position(loader, epoch, start_iter)   # or loader.sampler.set_epoch / set_start_iter
    it = iter(loader)

Workers persist across phases (``persistent_workers``); the sampler yields ``(epoch, idx)`` so
they need no epoch message. The loader draws its worker base seed from its own generator seeded
from (SEED_VALUE, rank), never from the global torch generator.
"""

import functools
import logging
import os
import random
import re
import signal
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from ssl_engine.data.collators import build_collator, default_collate
from ssl_engine.data.sampler import StatefulDistributedSampler
from ssl_engine.data.sources import data_key
from ssl_engine.errors import UserError
from ssl_engine.forkserver import preload_forkserver
from ssl_engine.socket_dir import ensure_short_socket_dir

log = logging.getLogger(__name__)


def worker_init_fn(worker_id: int, main_pid: Optional[int] = None) -> None:
    """Seed numpy and python ``random`` in a worker from torch's per-worker seed, ignore the
    preemption signals, and watch the training process (``main_pid``).

    Seeding is harmless by design: the dataset reseeds every generator per sample; this only
    keeps user code that draws randomness outside ``__getitem__`` from sharing one stream.
    """
    global _INHERITED_TEMPDIR
    _INHERITED_TEMPDIR = _mp_tempdir()  # the rank's, when it made one before starting this worker
    seed = torch.initial_seed()
    np.random.seed(seed % (1 << 32))
    random.seed(seed)
    # Preemption signals are for the training process (it checkpoints at a step boundary);
    # a scheduler that signals the whole job must not kill the workers feeding that step.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    if main_pid is not None:
        threading.Thread(target=_exit_when_gone, args=(main_pid,), name="main-watchdog", daemon=True).start()
    _end_worker_on_unsent_batch(main_pid)


def _unsent_batch_file(main_pid: int, worker: Any) -> str:
    """Where a worker (a pid, or ``*``) leaves, for its training process, why it could not send a batch."""
    return os.path.join(tempfile.gettempdir(), f"ssl_engine_unsent_batch_{main_pid}_{worker}.txt")


_INHERITED_TEMPDIR: Optional[str] = None


def _mp_tempdir() -> Optional[str]:
    """This process's multiprocessing temp folder (``pymp-*``; multiprocessing.util.get_temp_dir
    keeps it in the process config, which a child process inherits), None before one is made."""
    import multiprocessing

    return multiprocessing.current_process()._config.get("tempdir")


def _exit_worker(code: int) -> None:
    """``os._exit`` for a loader worker, after removing the temporary folder multiprocessing made
    for it (``pymp-*``, holding the socket it shares tensors through): ``os._exit`` runs no
    finalizer, and the folder would be left in TMPDIR. A folder inherited from the rank is the
    rank's to remove."""
    import shutil

    tempdir = _mp_tempdir()
    if tempdir and tempdir != _INHERITED_TEMPDIR:
        shutil.rmtree(tempdir, ignore_errors=True)
    os._exit(code)


def _end_worker_on_unsent_batch(main_pid: Optional[int]) -> None:
    """Make a batch this worker cannot send end the worker, instead of being dropped.

    A worker's batches leave through a multiprocessing queue whose background thread pickles
    them. When that fails (a value in the batch that does not pickle, such as a lambda or an
    open file from a user's transform or collator; shared memory or a socket that cannot be
    had), the thread prints a traceback and drops the batch, and the rank waits for it
    forever. Ended, the worker is seen gone by the rank's DataLoader within seconds. For a
    value that does not pickle (the user's to fix) the worker leaves its line in a file that
    ``unsent_batch_error`` turns into the rank's UserError (one line, exit code 2); other
    causes are printed here, and the rank stops with torch's "exited unexpectedly".
    Runs in the worker only (worker_init_fn), before its first batch.
    """
    import multiprocessing.queues
    import pickle
    import sys

    def on_error(error: BaseException, batch: Any) -> None:
        users = isinstance(error, (pickle.PicklingError, TypeError, AttributeError))
        hint = ("; every value a collator returns must pickle (tensors, numbers, strings, lists and dicts "
                "of them)" if users else "")
        line = f"loader worker (pid {os.getpid()}) cannot send a batch to its rank: {type(error).__name__}: {error}{hint}"
        if users and main_pid is not None:
            try:
                with open(_unsent_batch_file(main_pid, os.getpid()), "w") as f:
                    f.write(line)
                _exit_worker(1)
            except OSError:
                pass
        sys.stderr.write(f"error: {line}; ending the worker\n")
        sys.stderr.flush()
        _exit_worker(1)

    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(on_error)


_WORKER_EXITED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) exited unexpectedly")


def unsent_batch_error(error: BaseException) -> Optional[UserError]:
    """For torch's "DataLoader worker (pid ...) exited unexpectedly": the UserError of a worker
    of this process that ended on a batch it could not send (see _end_worker_on_unsent_batch),
    else None. The files stay: run_engine removes them all as the rank ends."""
    match = _WORKER_EXITED.search(str(error)) if isinstance(error, RuntimeError) else None
    found: Optional[UserError] = None
    for pid in match.group(1).split(",") if match else ():
        try:
            with open(_unsent_batch_file(os.getpid(), int(pid))) as f:
                found = UserError(f.read())
            break
        except OSError:
            continue
    return found


def remove_unsent_batch_files(main_pids: List[int]) -> None:
    """Remove what the workers of the processes ``main_pids`` left for them and they never read
    (a rank stopped because another rank failed first)."""
    import glob

    for pid in main_pids:
        for path in glob.glob(_unsent_batch_file(pid, "*")):
            try:
                os.unlink(path)
            except OSError:
                pass


def _exit_when_gone(main_pid: int, every_s: float = 1.0) -> None:
    """End this worker once the training process is gone.

    torch's own check watches the worker's parent, which for a forkserver worker is the
    forkserver, not the training process; after a SIGKILL of the training process such workers
    (which ignore SIGTERM, see above) would otherwise live on, and keep the forkserver alive.
    """
    from ssl_engine.processes import pid_alive

    while pid_alive(main_pid):
        time.sleep(every_s)
    _exit_worker(0)


def stop_workers(iterator: Any) -> None:
    """Stop the worker processes of a DataLoader iterator now; nothing for one without workers.

    Workers ignore SIGTERM (see worker_init_fn), so an iterator must not be left for the
    interpreter's exit, where multiprocessing terminates daemon children with SIGTERM and then
    waits for them: the process would never end. Called while a run ends, often on its error:
    it never raises (a failure is logged at debug level), so it cannot hide that error.
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's multi-process iterator
    if shutdown is None:
        return
    try:
        shutdown()  # asks each worker to stop and joins it (torch's fallback, SIGTERM, is ignored here)
    except Exception as e:  # noqa: BLE001 - e.g. torch's SIGCHLD check raising for a worker that died
        log.debug("stopping loader workers: %s: %s", type(e).__name__, e)
    for worker in getattr(iterator, "_workers", ()):
        if worker.is_alive():  # stuck (a hung read, a deadlocked decoder): the one signal it cannot ignore
            worker.kill()
            worker.join(timeout=5)


def max_loader_workers(cpus: int) -> int:
    """The most loader workers a rank may start on a machine with ``cpus`` CPUs: max(64, 8 x cpus).

    Generous (I/O-bound decoding can use a few workers per CPU), yet far below counts that
    take minutes to start or exhaust the process table and memory, which look like a hang.
    """
    return max(64, 8 * cpus)


def check_num_workers(num_workers: int, cpus: Optional[int] = None) -> None:
    """A UserError when ``config.DATA.NUM_DATALOADER_WORKERS`` is more than this machine
    (``cpus`` CPUs, default ``os.cpu_count()``) can start; checked where the rank runs."""
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    limit = max_loader_workers(cpus)
    if num_workers > limit:
        raise UserError(
            f"config.DATA.NUM_DATALOADER_WORKERS={num_workers} is more loader workers per rank than this machine "
            f"({cpus} CPUs) can start: at most {limit} (max(64, 8 x CPUs)); a usual choice is about as many as the "
            f"CPUs per rank"
        )


def worker_count_note(num_workers: int, ranks_here: int, cpus: Optional[int] = None) -> Optional[str]:
    """The one warning for more loader workers per rank than the CPUs this process may use (torch
    says it on every new iterator of every rank, which the tool hides); None when they fit."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # no affinity on this platform: the machine's count, as torch falls back to
            cpus = os.cpu_count() or 1
    if num_workers <= cpus:
        return None
    total = f" ({ranks_here} ranks here: {ranks_here * num_workers} workers)" if ranks_here > 1 else ""
    return (f"config.DATA.NUM_DATALOADER_WORKERS={num_workers} loader workers per rank{total} on {cpus} CPUs: "
            f"they may slow each other down; about {max(1, cpus // max(1, ranks_here))} per rank fits this machine, "
            f"unless loading mostly waits on a disk or network")


def build_dataloader(
    dataset: Any,
    cfg: Any,
    split: str,
    rank: int,
    world_size: int,
    device: str,
    pad: bool = True,
    shuffle: Optional[bool] = None,
    check_cpus: bool = True,
) -> DataLoader:
    """A DataLoader over ``dataset`` for ``split`` on ``rank`` of ``world_size`` processes.

    Keys: ``DATA.<split>.BATCHSIZE_PER_REPLICA``, ``DATA.<split>.DROP_LAST``,
    ``DATA.<split>.COLLATE_FUNCTION``, ``DATA.<split>.COLLATE_FUNCTION_PARAMS``,
    ``DATA.NUM_DATALOADER_WORKERS``, ``DATA.PIN_MEMORY`` (only when ``device`` is a GPU),
    ``MULTI_PROCESSING_METHOD`` (workers' start method), ``SEED_VALUE``.
    Only TRAIN is shuffled unless ``shuffle`` says otherwise. ``pad=False`` gives the ranks
    uneven shares with every sample exactly once (see StatefulDistributedSampler); feature
    extraction uses it together with ``shuffle=False``. ``check_cpus=False`` leaves out the
    worker count's bound from this machine's CPUs (see ``check_num_workers``), for the check
    before launch, which may run on another machine than the ranks (a SLURM login node).
    """
    data = cfg.get("DATA", {}) or {}
    scfg = data.get(split, {}) or {}
    batch_size = int(scfg.get("BATCHSIZE_PER_REPLICA", 256))
    if batch_size < 1:
        raise UserError(f"{data_key(split, 'BATCHSIZE_PER_REPLICA')} must be >= 1, got {batch_size}")
    drop_last = bool(scfg.get("DROP_LAST", False))
    n = len(dataset)
    if n == 0:
        raise UserError(f"the {split} dataset is empty; check {data_key(split, 'DATA_PATHS')}")
    if drop_last and n < batch_size * world_size:
        raise UserError(
            f"{data_key(split, 'DROP_LAST')} is True but the {split} dataset has {n} samples, fewer than one "
            f"global batch ({data_key(split, 'BATCHSIZE_PER_REPLICA')}={batch_size} x world size {world_size} = "
            f"{batch_size * world_size}): every batch would be dropped; lower BATCHSIZE_PER_REPLICA or set "
            f"DROP_LAST=False"
        )
    seed = int(cfg.get("SEED_VALUE", 0))
    sampler = StatefulDistributedSampler(
        n,
        num_replicas=world_size,
        rank=rank,
        shuffle=(split == "TRAIN") if shuffle is None else bool(shuffle),
        seed=seed,
        drop_last=drop_last,
        batch_size=batch_size,
        pad=pad,
    )
    collate_fn = build_collator(
        str(scfg.get("COLLATE_FUNCTION", "default_collate")), scfg.get("COLLATE_FUNCTION_PARAMS", {}) or {}, split
    )
    if getattr(collate_fn, "fn", collate_fn) is default_collate and callable(getattr(dataset, "reads_batches", None)):
        dataset.collated_reads = dataset.reads_batches()  # whole batches from sources with get_batch
    num_workers = int(data.get("NUM_DATALOADER_WORKERS", 0))
    if num_workers < 0:
        raise UserError(f"config.DATA.NUM_DATALOADER_WORKERS must be >= 0, got {num_workers}")
    if check_cpus:
        check_num_workers(num_workers)
    pin = bool(data.get("PIN_MEMORY", True)) and str(device).lower() in ("gpu", "cuda") and torch.cuda.is_available()
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + rank) % (1 << 63))
    kwargs: Dict[str, Any] = {}
    if num_workers > 0:
        if check_cpus:  # on the rank's machine (not in the pre-launch check, which may run on a login node)
            ensure_short_socket_dir()  # workers send batches through sockets there
        kwargs["persistent_workers"] = True
        kwargs["worker_init_fn"] = functools.partial(worker_init_fn, main_pid=os.getpid())
        method = cfg.get("MULTI_PROCESSING_METHOD")
        if method:
            kwargs["multiprocessing_context"] = str(method)
            if str(method) == "forkserver":
                preload_forkserver()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin,
        drop_last=drop_last,
        generator=generator,
        **kwargs,
    )


def set_loader_position(loader: DataLoader, epoch: int, start_iter: int = 0) -> None:
    """Make the next ``iter(loader)`` yield epoch ``epoch`` from batch ``start_iter`` on."""
    loader.sampler.set_epoch(epoch)
    loader.sampler.set_start_iter(start_iter)


def get_loader_state(loader: DataLoader) -> Dict[str, Any]:
    """The sampler position (epoch, start_iter, seed) as plain ints, for checkpoints."""
    return loader.sampler.state_dict()


def set_loader_state(loader: DataLoader, state: Dict[str, Any]) -> None:
    """Restore what ``get_loader_state`` returned."""
    loader.sampler.load_state_dict(state)
