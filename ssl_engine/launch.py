"""Start the processes of a run: in-process, N ranks on this node, a node of a multi-node
job, under torchrun (env://), or a SLURM job through submitit.

Ranks fail together: when a rank raises, the launcher ends the others within seconds,
exits non-zero and shows the failing rank's traceback with its rank number.
"""

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, List, Optional

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.distributed import RankInfo, env_rank_info
from ssl_engine.errors import PREEMPTED_EXIT_CODE, USER_ERROR_EXIT_CODE, ConfigError, UserError

log = logging.getLogger(__name__)

KILL_GRACE_SECONDS = 10.0


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(cfg: AttrDict) -> str:
    return "nccl" if cfg.MACHINE.DEVICE == "gpu" else "gloo"


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and "SSL_ENGINE_SPAWNED" not in os.environ


def check_devices(cfg: AttrDict) -> None:
    """On gpu, CUDA must be there with a GPU per local rank."""
    if cfg.MACHINE.DEVICE != "gpu":
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError("config.MACHINE.DEVICE=gpu but no CUDA device is available; set config.MACHINE.DEVICE=cpu")
    if cfg.DISTRIBUTED.NUM_PROC_PER_NODE > n and not under_torchrun():
        raise ConfigError(
            f"config.DISTRIBUTED.NUM_PROC_PER_NODE={cfg.DISTRIBUTED.NUM_PROC_PER_NODE} but this machine has {n} GPU(s); "
            f"use at most {n} ranks per node"
        )


def init_method_for(cfg: AttrDict, node_id: int) -> str:
    d = cfg.DISTRIBUTED
    if d.INIT_METHOD == "env":
        return "env://"
    if d.INIT_METHOD == "file":
        path = d.RUN_ID if d.RUN_ID != "auto" else os.path.join(tempfile.mkdtemp(prefix="ssl_engine_rdzv_"), "rdzv")
        return f"file://{os.path.abspath(path)}"
    if d.RUN_ID == "auto":
        if d.NUM_NODES > 1:
            raise ConfigError(
                "config.DISTRIBUTED.RUN_ID must be host:port of node 0 when NUM_NODES > 1 "
                "(e.g. config.DISTRIBUTED.RUN_ID=10.0.0.1:29500), the same on every node"
            )
        return f"tcp://127.0.0.1:{find_free_port()}"
    if ":" not in str(d.RUN_ID):
        raise ConfigError(f"config.DISTRIBUTED.RUN_ID={d.RUN_ID!r} is not host:port")
    return f"tcp://{d.RUN_ID}"


def _child(cfg: AttrDict, info: RankInfo, error_dir: str) -> None:
    """Body of a spawned rank: run, and on failure leave the traceback in error_dir."""
    os.environ["SSL_ENGINE_SPAWNED"] = "1"
    code = 0
    try:
        from ssl_engine.engines import run_engine

        run_engine(cfg, info)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        from ssl_engine.preemption import Preempted

        if isinstance(e, Preempted):
            code = PREEMPTED_EXIT_CODE
            text = str(e)
        elif isinstance(e, UserError):
            code = USER_ERROR_EXIT_CODE
            text = str(e)
        else:
            code = 1
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            Path(error_dir, f"rank{info.rank}.err").write_text(f"{time.time()}\n{text}")
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cleanup_temp_files(folder: str, pids: List[int]) -> None:
    """Remove temporary files that killed ranks may have left in the checkpoint folder."""
    p = Path(folder)
    if not p.is_dir():
        return
    for f in p.iterdir():
        if f.name.startswith(".") and ".tmp." in f.name and any(f.name.endswith(f".tmp.{pid}") for pid in pids):
            try:
                f.unlink()
            except OSError:
                pass


def spawn_ranks(cfg: AttrDict, node_id: int = 0) -> int:
    """Start NUM_PROC_PER_NODE ranks of this node and wait; returns the job's exit code."""
    nproc = cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    world = nproc * cfg.DISTRIBUTED.NUM_NODES
    init_method = init_method_for(cfg, node_id)
    ctx = mp.get_context(cfg.MULTI_PROCESSING_METHOD)
    error_dir = tempfile.mkdtemp(prefix="ssl_engine_err_")
    procs = []
    for local_rank in range(nproc):
        info = RankInfo(node_id * nproc + local_rank, local_rank, world, init_method, backend_for(cfg))
        p = ctx.Process(target=_child, args=(cfg, info, error_dir), name=f"rank{info.rank}", daemon=False)
        p.start()
        procs.append(p)
    log.info("started %d ranks of %d (node %d) with %s", nproc, world, node_id, init_method)
    forwarded = {}

    def forward(signum: int, frame: Any) -> None:  # preemption and Ctrl-C reach every rank
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        forwarded[sig] = signal.signal(sig, forward)
    try:
        return _wait(procs, error_dir)
    finally:
        for sig, old in forwarded.items():
            signal.signal(sig, old)
        _cleanup_temp_files(str(cfg.CHECKPOINT.DIR), [p.pid for p in procs])
        for f in Path(error_dir).iterdir():
            f.unlink()
        os.rmdir(error_dir)


def _wait(procs: List[Any], error_dir: str) -> int:
    failed_at: Optional[float] = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        codes = [p.exitcode for p in procs if not p.is_alive()]
        bad = [c for c in codes if c not in (0, None)]
        if bad and failed_at is None:
            failed_at = time.time()
            for p in alive:  # ask the others to stop: SIGINT unwinds python cleanly
                os.kill(p.pid, signal.SIGINT)
        if failed_at is not None and alive and time.time() - failed_at > KILL_GRACE_SECONDS:
            for p in alive:
                p.kill()
        if not alive:
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    exit_codes = [p.exitcode for p in procs]
    if all(c == 0 for c in exit_codes):
        return 0
    errors = []
    for f in Path(error_dir).glob("rank*.err"):
        stamp, _, text = f.read_text().partition("\n")
        errors.append((float(stamp), int(f.stem[4:]), text))
    errors.sort()
    first_code = next((c for c in exit_codes if c not in (0,)), 1)
    if errors:
        _, rank, text = errors[0]
        code = [p.exitcode for p in procs][rank] if rank < len(procs) else first_code
        if code == USER_ERROR_EXIT_CODE:
            raise UserError(text.strip())
        if code == PREEMPTED_EXIT_CODE:
            log.warning("%s", text.strip())
            return PREEMPTED_EXIT_CODE
        sys.stderr.write(f"rank {rank} failed first:\n{text}\n")
        return code if code and code > 0 else 1
    killed = [(i, c) for i, c in enumerate(exit_codes) if c not in (0, None)]
    sys.stderr.write(f"ranks ended abnormally: {', '.join(f'rank {i} exit {c}' for i, c in killed)}\n")
    return 1


def launch(cfg: AttrDict, node_id: int = 0) -> int:
    """Run ``cfg`` as asked by its DISTRIBUTED / SLURM settings; returns the exit code."""
    from ssl_engine.engines import run_engine
    from ssl_engine.preemption import Preempted

    check_devices(cfg)
    if cfg.SLURM.USE_SLURM:
        from ssl_engine.slurm import submit

        return submit(cfg)
    if under_torchrun():
        info = env_rank_info()
        info.backend = backend_for(cfg)
        expected = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
        if info.world_size != expected and info.rank == 0:
            log.warning("torchrun's WORLD_SIZE=%d wins over the config's NUM_NODES*NUM_PROC_PER_NODE=%d",
                        info.world_size, expected)
        return _in_process(cfg, info)
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    if not 0 <= node_id < cfg.DISTRIBUTED.NUM_NODES:
        raise ConfigError(f"node_id={node_id} is out of range for DISTRIBUTED.NUM_NODES={cfg.DISTRIBUTED.NUM_NODES}")
    if world == 1:
        return _in_process(cfg, RankInfo(backend=backend_for(cfg)))
    return spawn_ranks(cfg, node_id)


def _in_process(cfg: AttrDict, info: RankInfo) -> int:
    from ssl_engine.engines import run_engine
    from ssl_engine.preemption import Preempted

    try:
        run_engine(cfg, info)
    except Preempted as e:
        log.warning("%s", e)
        return PREEMPTED_EXIT_CODE
    return 0
