"""Run a job on SLURM through submitit, and keep it going across time limits and preemptions.

One submitit task per node. Each task is a light supervisor that spawns the node's
NUM_PROC_PER_NODE ranks (ssl_engine.launch.RankGroup), exactly as a local multi-GPU run
does. We chose this over one task per GPU because the supervisor, not a training process,
receives submitit's checkpoint signal: it can ask its ranks to stop at the next step
boundary, wait for the checkpoint to be on disk, and only then requeue the job. (With one
task per GPU, submitit's handler would run inside a training process, in the middle of a
step, and requeue it before any checkpoint of the current position exists.) It also keeps
one code path for "ranks fail together" on a laptop, a workstation and a cluster.

Time limit / preemption: submitit asks for ``--signal=USR2@SLURM.SIGNAL_DELAY_S``; on that
signal :meth:`TrainingJob.checkpoint` sends SIGUSR1 (our preemption signal) to the ranks,
which agree on a step, write ``model_iteration{I}.torch`` and exit; it then returns a
``DelayedSubmission`` of the job, which submitit requeues. The requeued job starts the
ranks again and the train engine resumes from the newest good checkpoint of CHECKPOINT.DIR.
A SIGTERM from SLURM (preemption) reaches the ranks directly and also makes them write a
checkpoint before they exit.

``SLURM.EXECUTOR=local`` runs the very same job with submitit's LocalExecutor on this
machine (one node), including the checkpoint-and-requeue path; ``debug`` runs it in this
process.
"""

import contextlib
import copy
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import submitit

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import PREEMPTED_EXIT_CODE, ConfigError

log = logging.getLogger(__name__)

EXECUTORS = ("slurm", "local", "debug")


def time_limit_minutes(cfg: AttrDict) -> int:
    """SLURM.TIME_HOURS * 60 + SLURM.TIME_MINUTES, checked to be positive."""
    minutes = int(cfg.SLURM.TIME_HOURS) * 60 + int(cfg.SLURM.TIME_MINUTES)
    if minutes <= 0:
        raise ConfigError(
            f"config.SLURM.TIME_HOURS={cfg.SLURM.TIME_HOURS} and TIME_MINUTES={cfg.SLURM.TIME_MINUTES} give a time "
            f"limit of {minutes} minutes; set a positive time limit"
        )
    return minutes


def _check(cfg: AttrDict) -> None:
    s = cfg.SLURM
    if s.EXECUTOR not in EXECUTORS:
        raise ConfigError(f"config.SLURM.EXECUTOR={s.EXECUTOR!r} is not valid: use one of {', '.join(EXECUTORS)}")
    if s.EXECUTOR != "slurm" and cfg.DISTRIBUTED.NUM_NODES > 1:
        raise ConfigError(
            f"config.SLURM.EXECUTOR={s.EXECUTOR} runs on this machine only: set config.DISTRIBUTED.NUM_NODES=1 "
            "or config.SLURM.EXECUTOR=slurm"
        )
    if s.EXECUTOR == "slurm" and (shutil.which("sbatch") is None or shutil.which("srun") is None):
        raise ConfigError(
            "config.SLURM.USE_SLURM=true but sbatch/srun are not found on this machine; submit from a SLURM login "
            "node, or set config.SLURM.EXECUTOR=local to run the same job here"
        )
    if s.NUM_CPU_PER_PROC < 1 or s.MEM_GB <= 0 or not 0 < s.PORT_ID < 65536:
        raise ConfigError(
            f"config.SLURM: NUM_CPU_PER_PROC={s.NUM_CPU_PER_PROC} must be >= 1, MEM_GB={s.MEM_GB} > 0 and "
            f"PORT_ID={s.PORT_ID} a port number (1-65535)"
        )
    if s.SIGNAL_DELAY_S < 10 or s.MAX_NUM_TIMEOUT < 0:
        raise ConfigError(
            f"config.SLURM.SIGNAL_DELAY_S={s.SIGNAL_DELAY_S} must be >= 10 (seconds to write a checkpoint) and "
            f"MAX_NUM_TIMEOUT={s.MAX_NUM_TIMEOUT} >= 0"
        )
    if s.SIGNAL_DELAY_S >= 60 * time_limit_minutes(cfg):
        raise ConfigError(
            f"config.SLURM.SIGNAL_DELAY_S={s.SIGNAL_DELAY_S} must be shorter than the time limit "
            f"({time_limit_minutes(cfg)} min from TIME_HOURS/TIME_MINUTES)"
        )
    if not isinstance(s.ADDITIONAL_PARAMETERS, dict):
        raise ConfigError(
            f"config.SLURM.ADDITIONAL_PARAMETERS must be a mapping of sbatch options (e.g. {{mail-type: END}}), "
            f"got {s.ADDITIONAL_PARAMETERS!r}"
        )


def log_folder(cfg: AttrDict) -> Path:
    """SLURM.LOG_FOLDER as an absolute path (submitit's %j stands for the job id)."""
    return Path(str(cfg.SLURM.LOG_FOLDER)).expanduser().absolute()


def build_executor(cfg: AttrDict) -> Any:
    """The submitit executor of SLURM.EXECUTOR with the job's resources from the config."""
    _check(cfg)
    s, d = cfg.SLURM, cfg.DISTRIBUTED
    folder = log_folder(cfg)
    gpus = d.NUM_PROC_PER_NODE if cfg.MACHINE.DEVICE == "gpu" else 0
    minutes = time_limit_minutes(cfg)
    if s.EXECUTOR == "debug":
        return submitit.DebugExecutor(folder)
    if s.EXECUTOR == "local":
        ex = submitit.LocalExecutor(folder, max_num_timeout=int(s.MAX_NUM_TIMEOUT))
        ex.update_parameters(
            timeout_min=minutes, nodes=1, tasks_per_node=1, gpus_per_node=gpus, signal_delay_s=int(s.SIGNAL_DELAY_S)
        )
        return ex
    ex = submitit.SlurmExecutor(folder, max_num_timeout=int(s.MAX_NUM_TIMEOUT))
    params: Dict[str, Any] = {
        "job_name": str(s.NAME),
        "time": minutes,
        "nodes": int(d.NUM_NODES),
        "ntasks_per_node": 1,  # one supervisor per node; it spawns the node's ranks
        "cpus_per_task": int(s.NUM_CPU_PER_PROC) * int(d.NUM_PROC_PER_NODE),
        "mem": f"{int(s.MEM_GB)}GB" if float(s.MEM_GB) == int(s.MEM_GB) else f"{int(float(s.MEM_GB) * 1024)}MB",
        "signal_delay_s": int(s.SIGNAL_DELAY_S),
    }
    if gpus:
        params["gpus_per_node"] = gpus
    for key, value in (("partition", s.PARTITION), ("comment", s.COMMENT), ("constraint", s.CONSTRAINT)):
        if value:
            params[key] = str(value)
    if s.ADDITIONAL_PARAMETERS:
        params["additional_parameters"] = dict(s.ADDITIONAL_PARAMETERS)
    ex.update_parameters(**params)
    return ex


class TrainingJob(submitit.helpers.Checkpointable):
    """What each submitit task runs: this node's ranks, requeued with their checkpoint on a time limit."""

    def __init__(self, cfg: AttrDict) -> None:
        self.cfg = cfg
        self._group: Optional[Any] = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"cfg": self.cfg, "_group": None}

    def node_config(self) -> AttrDict:
        """The config as this node runs it: rendezvous on the job's first node at SLURM.PORT_ID."""
        cfg = copy.deepcopy(self.cfg)
        d = cfg.DISTRIBUTED
        if d.NUM_NODES > 1:
            env = submitit.JobEnvironment()
            d.INIT_METHOD, d.RUN_ID = "tcp", f"{env.hostnames[0]}:{int(cfg.SLURM.PORT_ID)}"
        elif d.INIT_METHOD == "env":
            d.INIT_METHOD = "tcp"
        return cfg

    def __call__(self) -> str:
        from ssl_engine.launch import RankGroup
        from ssl_engine.logger import setup_logging

        setup_logging(0, None, bool(self.cfg.VERBOSE))
        logging.getLogger("submitit").propagate = False  # it has its own handler; no double lines
        env = submitit.JobEnvironment()
        cfg = self.node_config()
        log.info("%s: node %d of %d runs %d rank(s); checkpoints in %s", env, env.node, cfg.DISTRIBUTED.NUM_NODES,
                 cfg.DISTRIBUTED.NUM_PROC_PER_NODE, cfg.CHECKPOINT.DIR)
        self._group = RankGroup(cfg, node_id=env.node)
        try:
            code = self._group.run()
        finally:
            self._group = None
        if code == 0:
            return f"finished: {cfg.CHECKPOINT.DIR}"
        if code == PREEMPTED_EXIT_CODE:
            if env.node != 0:  # node 0 checkpoints and requeues the whole job
                return "stopped for a preemption; node 0 requeues the job"
            raise RuntimeError(
                f"stopped on a preemption signal after writing a checkpoint in {cfg.CHECKPOINT.DIR}; SLURM requeues "
                "preempted jobs when the partition allows it, otherwise submit the same command again to resume"
            )
        raise RuntimeError(f"the run ended with exit code {code}; the failing rank's traceback is in {env.paths.stderr}")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on the time-limit / preemption signal: checkpoint now, then requeue."""
        group = self._group
        if group is not None:
            wait_s = max(5.0, float(self.cfg.SLURM.SIGNAL_DELAY_S) - 15.0)
            log.warning("time limit or preemption: asking the ranks to checkpoint (waiting up to %.0f s)", wait_s)
            if not group.stop_for_preemption(wait_s):
                log.warning("the ranks did not stop in time; the requeued job resumes from the newest good checkpoint")
        cfg = copy.deepcopy(self.cfg)
        cfg.CHECKPOINT.AUTO_RESUME = True  # the requeued job continues this run
        return submitit.helpers.DelayedSubmission(type(self)(cfg))


@contextlib.contextmanager
def _std_streams_to(path: Path) -> Iterator[None]:
    """Point file descriptors 1 and 2 at ``path`` (appending) for what starts inside, then restore them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in saved + [fd]:
            os.close(f)


def submit(cfg: AttrDict) -> int:
    """Submit ``cfg`` (SLURM.USE_SLURM); prints the job id and the log folder. Returns 0 once submitted
    (``debug`` runs the job here and returns when it ends)."""
    executor = build_executor(cfg)
    Path(str(cfg.CHECKPOINT.DIR)).mkdir(parents=True, exist_ok=True)
    if cfg.SLURM.EXECUTOR == "local":
        # submitit's local controller outlives this command; it must not hold our stdout/stderr
        # (a pipe such as `| tee` would stay open until the job ends)
        with _std_streams_to(log_folder(cfg) / "local_controller.log"):
            job = executor.submit(TrainingJob(cfg))
    else:
        job = executor.submit(TrainingJob(cfg))
    folder = job.paths.stdout.parent
    print(f"submitted job {job.job_id} ({cfg.SLURM.EXECUTOR}, {cfg.SLURM.NAME}); logs in {folder}", flush=True)
    print(f"  stdout: {job.paths.stdout}\n  stderr: {job.paths.stderr}\n  checkpoints: {cfg.CHECKPOINT.DIR}", flush=True)
    if cfg.SLURM.EXECUTOR == "debug":
        result = job.result()
        print(result, flush=True)
    return 0
