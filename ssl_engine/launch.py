"""Start the processes of a run: in-process, N ranks on this node, a node of a multi-node
job, under torchrun (env://), or a SLURM job through submitit (ssl_engine.slurm).

Ranks fail together: when a rank raises, the launcher asks the others to stop (SIGINT,
then SIGKILL after KILL_GRACE_SECONDS), exits non-zero and shows the traceback of the rank
that failed first, with its rank number. Spawned ranks die with their launcher, and the
temporary files of killed ranks are removed from the checkpoint folder.

SIGTERM and SIGUSR1 are the engine's preemption signals (ssl_engine.preemption): the
launcher forwards them to its ranks, which write a checkpoint and exit with
PREEMPTED_EXIT_CODE; they are never used to end a failed job's survivors.
"""

import json
import logging
import multiprocessing as mp
import os
import re
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.distributed import RankInfo, env_rank_info
from ssl_engine.errors import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    ConfigError,
    NonFiniteLossError,
    UserError,
    killed_worker_line,
    quiet_killed_worker_echoes,
)
from ssl_engine.socket_dir import ensure_short_socket_dir

log = logging.getLogger(__name__)

KILL_GRACE_SECONDS = 10.0  # after SIGINT, survivors of a failed rank get this long before SIGKILL
_NON_FINITE_MARK = "non-finite loss: "  # how a rank's error file marks a NonFiniteLossError
_SPAWNED_ENV = "SSL_ENGINE_SPAWNED"  # set in ranks we start, so they never think they run under torchrun
# Held back while ranks start (the mask is inherited), released once a rank routes them to its
# preemption flag: a preemption signal in a rank's first seconds must not kill it.
_PREEMPTION_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}
# SIGINT too: a rank may inherit it ignored until _child installs its handler, and a blocked
# signal stays pending on Linux even then, so a stop sent while a rank starts is not lost.
_HELD_WHILE_STARTING = _PREEMPTION_SIGNALS | {signal.SIGINT}


def backend_for(cfg: AttrDict) -> str:
    """nccl on GPUs, gloo on CPUs (DISTRIBUTED.BACKEND is only a hint, the device decides)."""
    return "nccl" if cfg.MACHINE.DEVICE == "gpu" else "gloo"


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun() -> bool:
    """True in a process that torchrun (or another env:// launcher) started."""
    return all(k in os.environ for k in _TORCHRUN_ENV) and _SPAWNED_ENV not in os.environ


def check_torchrun_env() -> None:
    """Refuse torchrun's variables set by hand in a way no launch can use, before anything is
    built: RANK or WORLD_SIZE without the other two (the tool would ignore them and start ranks
    of its own, a second world beside the one they describe), or values that are not whole
    numbers with RANK below WORLD_SIZE."""
    if _SPAWNED_ENV in os.environ:
        return
    given = [k for k in _TORCHRUN_ENV if k in os.environ]
    if not given:
        return
    if len(given) < len(_TORCHRUN_ENV):
        if not {"RANK", "WORLD_SIZE"} & set(given):
            return  # LOCAL_RANK alone (left by another tool) says nothing about a world
        missing = [k for k in _TORCHRUN_ENV if k not in given]
        raise UserError(
            f"environment variable(s) {', '.join(f'{k}={os.environ[k]}' for k in given)} set without "
            f"{' and '.join(missing)}: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE, and the tool joins "
            "their world only when all three are set; set them all, or unset them to let the tool start its own ranks"
        )
    env_rank_info()  # whole numbers, RANK below WORLD_SIZE


def check_devices(cfg: AttrDict) -> None:
    """Fail before any process starts when the machine cannot run the config."""
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    if cfg.MACHINE.DEVICE != "gpu":
        if cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN and (world > 1 or under_torchrun()):
            raise ConfigError(
                "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=true needs GPUs (torch's SyncBatchNorm has no CPU "
                "version); set it to false with config.MACHINE.DEVICE=cpu"
            )
        return
    import torch

    n = torch.cuda.device_count()  # NVML-based: unlike is_available(), it does not poison fork for the ranks
    if n == 0 and not cfg.SLURM.USE_SLURM:
        raise ConfigError("config.MACHINE.DEVICE=gpu but no CUDA device is available; set config.MACHINE.DEVICE=cpu")
    if 0 < n < cfg.DISTRIBUTED.NUM_PROC_PER_NODE and not under_torchrun() and not cfg.SLURM.USE_SLURM:
        raise ConfigError(
            f"config.DISTRIBUTED.NUM_PROC_PER_NODE={cfg.DISTRIBUTED.NUM_PROC_PER_NODE} but this machine has {n} GPU(s); "
            f"use at most {n} ranks per node"
        )


RDZV_PREFIX, ERR_PREFIX = "ssl_engine_rdzv_", "ssl_engine_err_"


def launcher_temp_dir(prefix: str, parent: Optional[str] = None) -> str:
    """A fresh folder ``<prefix><host>_<pid>_<random>`` for this launcher's ranks, removed at its end.

    A launcher killed with SIGKILL cannot remove its folders; the next launcher does: folders of
    the same kind, made on this host by a launcher whose pid no longer runs, are removed first
    (a folder of another host, on a shared temp dir, or without a pid in its name, is left alone).
    """
    import socket

    from ssl_engine.processes import pid_alive

    mine = f"{prefix}{socket.gethostname()}_"
    base = parent or tempfile.gettempdir()
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for entry in entries:
        m = re.fullmatch(rf"{re.escape(mine)}(\d+)_\w+", entry)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}_", dir=parent)


def init_method_for(cfg: AttrDict) -> Tuple[str, Optional[str]]:
    """The rendezvous URL of the ranks, and a temporary folder to remove at the end (or None)."""
    d = cfg.DISTRIBUTED
    if d.INIT_METHOD == "env":
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ConfigError(
                f"config.DISTRIBUTED.INIT_METHOD=env needs {' and '.join(missing)} in the environment (torchrun sets "
                "them); use INIT_METHOD=tcp with RUN_ID=host:port, or launch with torchrun"
            )
        return "env://", None
    if d.INIT_METHOD == "file" and d.RUN_ID != "auto":
        return f"file://{rendezvous_file(str(d.RUN_ID), int(d.NUM_NODES))}", None
    if d.RUN_ID == "auto":
        if d.NUM_NODES > 1:
            if d.INIT_METHOD == "file":
                raise ConfigError(
                    "config.DISTRIBUTED.INIT_METHOD=file with NUM_NODES > 1 needs config.DISTRIBUTED.RUN_ID set to "
                    "a file path on a file system every node shares"
                )
            raise ConfigError(
                "config.DISTRIBUTED.RUN_ID must be host:port of node 0 when NUM_NODES > 1 "
                "(e.g. config.DISTRIBUTED.RUN_ID=10.0.0.1:29500), the same on every node"
            )
        # One node: the ranks meet through a file in a fresh folder, tcp or file alike. A free
        # port found now would stay free only until rank 0 binds it seconds later, and another
        # job starting on the node could take it in between (its ranks would join ours). The
        # file is locked with flock, which a cluster's TMPDIR on Lustre or NFS may not offer:
        # /dev/shm (a local tmpfs) comes first.
        shm = "/dev/shm"
        local = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
        folder = launcher_temp_dir(RDZV_PREFIX, local)
        return f"file://{os.path.join(folder, 'rendezvous')}", folder
    host, _, port = str(d.RUN_ID).rpartition(":")
    one_node = "; on one node, auto (the default) needs no address" if d.NUM_NODES == 1 else ""
    if not host or not port.isdigit():
        raise ConfigError(f"config.DISTRIBUTED.RUN_ID={d.RUN_ID!r} is not host:port of node 0 (e.g. "
                          f"10.0.0.1:29500){one_node}")
    if not 1 <= int(port) <= 65535:  # port 0 would bind a random port no other rank can know
        raise ConfigError(f"config.DISTRIBUTED.RUN_ID={d.RUN_ID!r}: port {port} is not a port the ranks can meet "
                          f"at; give one in 1-65535 that is free on node 0 (e.g. 10.0.0.1:29500){one_node}")
    return f"tcp://{d.RUN_ID}", None


def rendezvous_file(run_id: str, num_nodes: int) -> str:
    """The absolute path of ``RUN_ID`` under INIT_METHOD=file, checked before any rank starts:
    torch waits minutes for a file whose folder is missing and then fails with a traceback, and
    a file left by a killed run makes the new ranks try to reach that run's dead ones."""
    path = os.path.abspath(run_id)
    key = f"config.DISTRIBUTED.RUN_ID={run_id!r}"
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise ConfigError(f"{key} is a folder; with INIT_METHOD=file it names the file the ranks meet through "
                          f"(a file that does not exist yet, e.g. {os.path.join(path, 'rendezvous')})")
    if not os.path.isdir(folder):
        raise ConfigError(f"{key}: its folder {folder} does not exist; create it (on a file system every node "
                          "shares when NUM_NODES > 1), or leave RUN_ID=auto on one node")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: its folder {folder} is not writable; the ranks create the file there")
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    if num_nodes == 1 and size:  # on several nodes, another node's ranks may have written it already
        raise ConfigError(f"{key} already holds {size} bytes, left by a run that did not end (a clean run "
                          "removes it): delete the file or name a new one, or leave RUN_ID=auto on one node")
    return path


# ---------------------------------------------------------------------------- one rank


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no rank outlives a killed launcher."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _die_with_launcher(launcher_pid: int) -> None:
    """A forkserver rank: SIGKILL this process when the launcher ``launcher_pid`` ends.

    PR_SET_PDEATHSIG (``_die_with_parent``) watches a rank's parent, which for a forkserver rank
    is the forkserver. That one ends only when no process holds its alive pipe, and every rank
    and loader worker it forked holds it: a SIGKILLed launcher (the OOM killer, ``kill -9``) left
    its ranks training on to the end, writing checkpoints into the folder a rerun resumes from.
    A daemon thread waits on a pidfd of the launcher instead (no polling, no reused pid; a poll
    every second where the kernel has no pidfd). The rank's loader workers watch the rank and
    follow it; the forkserver then ends on its own.
    """
    try:
        fd: Optional[int] = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os._exit(1)  # the launcher died before we could watch it
    except (AttributeError, OSError):  # no pidfd_open (Python, kernel or seccomp): poll
        fd = None

    def wait() -> None:
        if fd is not None:
            poller = select.poll()  # not select.select, which refuses a descriptor >= 1024
            poller.register(fd, select.POLLIN)
            poller.poll()  # readable once the launcher has ended
        else:
            from ssl_engine.processes import pid_alive

            while pid_alive(launcher_pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="launcher-watchdog", daemon=True).start()


def _route_preemption_signals() -> None:
    """Preemption signals set the flag from the very start of the rank (not only once training runs)."""
    from ssl_engine import preemption

    preemption.install()
    usr = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2") if "SUBMITIT_EXECUTOR" in os.environ else ""
    sig = getattr(signal, f"SIG{usr}", None) if usr else None
    if sig is not None and sig not in (signal.SIGTERM, signal.SIGUSR1):
        # SLURM sends submitit's time-limit signal to every process of the job step
        signal.signal(sig, lambda signum, frame: preemption.request())


def _child(cfg: AttrDict, info: RankInfo, nproc: int, error_dir: str, parent_pid: int) -> None:
    """Body of a spawned rank: run, and on failure leave the traceback in error_dir."""
    _die_with_parent()
    if cfg.MULTI_PROCESSING_METHOD == "forkserver":  # the parent is the forkserver, not the launcher
        _die_with_launcher(parent_pid)
    elif os.getppid() != parent_pid:
        os._exit(1)  # the launcher died before we could ask to die with it
    try:
        os.setpgrp()  # the rank and its dataloader workers form one group the launcher can end at once
    except OSError:
        pass
    os.environ.update(
        {
            _SPAWNED_ENV: "1",
            "RANK": str(info.rank),
            "LOCAL_RANK": str(info.local_rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_WORLD_SIZE": str(nproc),
        }
    )
    # A rank is its own process group, so SIGINT reaches it only from the launcher: its "stop"
    # (a forwarded Ctrl-C, or another rank's failure). It must unwind the rank even when the
    # job inherited SIGINT ignored, as a script's background job does; the launcher keeps that
    # ignore for a Ctrl-C of its own (see Launcher.run).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    quiet_killed_worker_echoes(rank=True)
    _route_preemption_signals()
    code = 0
    try:
        # inside the try: a stop the launcher sent while this rank started (another rank failed
        # at once) is raised by this call as KeyboardInterrupt, and reported as "interrupted"
        # instead of escaping as multiprocessing's "Process rankN: Traceback"
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_WHILE_STARTING)
        from ssl_engine import startup_gc

        with startup_gc.paused():  # the engine's imports (see startup_gc)
            from ssl_engine.engines import run_engine
        run_engine(cfg, info)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report short
        from ssl_engine.preemption import Preempted

        if isinstance(e, Preempted):
            code, text = PREEMPTED_EXIT_CODE, str(e)
        elif isinstance(e, NonFiniteLossError):
            code, text = 1, _NON_FINITE_MARK + str(e)  # the launcher says it in one line, as one process does
        elif isinstance(e, UserError):
            code, text = USER_ERROR_EXIT_CODE, str(e)
        elif isinstance(e, KeyboardInterrupt):
            code, text = INTERRUPTED_EXIT_CODE, "interrupted"
        elif isinstance(e, SystemExit) and e.code in (0, None):
            code, text = 0, ""
        else:
            code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code > 0 else 1
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if code:
            try:
                from ssl_engine.engines import run as run_module

                stamp = run_module.failed_at or time.time()
                Path(error_dir, f"rank{info.rank}.err").write_text(f"{stamp!r}\n{code}\n{text}")
            except OSError:
                pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------- the ranks of one node


class RankGroup:
    """The NUM_PROC_PER_NODE ranks of this node: start them, watch them, end them together.

    ``run()`` starts the ranks and returns the node's exit code. ``stop_for_preemption()``
    may be called from a signal handler while ``run()`` waits (ssl_engine.slurm does so when
    submitit asks the job to checkpoint): the ranks write a checkpoint and exit.
    """

    def __init__(self, cfg: AttrDict, node_id: int = 0) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.nproc = cfg.DISTRIBUTED.NUM_PROC_PER_NODE
        self.world = self.nproc * cfg.DISTRIBUTED.NUM_NODES
        self.procs: List[Any] = []
        self.cause: Optional[int] = None  # index of the rank whose failure ended the job
        self._signalled_at: Optional[float] = None
        self._interrupts: List[float] = []  # when each Ctrl-C reached the launcher
        self._killed: Set[int] = set()  # ranks the launcher itself SIGKILLed
        self._seen_failed: List[int] = []  # the ranks seen ended with an error at the poll that set cause
        self._said_how_to_kill = False
        self._error_dir = ""

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        """Start the ranks, wait for all of them, and return the exit code of the node."""
        init_method, rdzv_dir = init_method_for(self.cfg)
        short_sockets_if_needed(self.cfg, spawns_ranks=True)  # a SLURM node's TMPDIR too
        self._error_dir = launcher_temp_dir(ERR_PREFIX)
        forwarded: Dict[int, Any] = {}

        def forward(signum: int, frame: Any) -> None:  # preemption and Ctrl-C reach every rank
            if signum == signal.SIGINT:
                self._interrupts.append(time.monotonic())
            self.send(signum)

        main_thread = threading.current_thread() is threading.main_thread()
        try:
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_WHILE_STARTING)
            try:
                self._start(init_method)
                for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT) if main_thread else ():
                    if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                        continue  # started with Ctrl-C ignored (a background job): like a one-process run
                    forwarded[sig] = signal.signal(sig, forward)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            from ssl_engine import preemption

            if preemption.requested():  # a preemption signal reached the launcher before the ranks ran
                self.send(signal.SIGTERM)
            self._wait()
            return self._report()
        finally:
            for sig, old in forwarded.items():
                signal.signal(sig, old)
            self._kill_alive()
            self._end_leftovers()
            self._cleanup(rdzv_dir)

    def _start(self, init_method: str) -> None:
        ctx = mp.get_context(self.cfg.MULTI_PROCESSING_METHOD)
        backend = backend_for(self.cfg)
        for local_rank in range(self.nproc):
            info = RankInfo(self.node_id * self.nproc + local_rank, local_rank, self.world, init_method, backend)
            p = ctx.Process(
                target=_child,
                args=(self.cfg, info, self.nproc, self._error_dir, os.getpid()),
                name=f"rank{info.rank}",
                daemon=False,  # ranks start their own dataloader workers
            )
            p.start()
            self.procs.append(p)
        log.info("started %d rank(s) of %d (node %d) with %s", self.nproc, self.world, self.node_id, init_method)

    def alive(self) -> List[Any]:
        return [p for p in self.procs if p.exitcode is None and p.is_alive()]

    def send(self, signum: int) -> None:
        """Send ``signum`` to every rank still running."""
        for p in self.alive():
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass

    def _wait(self) -> None:
        """Poll until every rank has ended; on the first failure stop the others."""
        while True:
            alive = self.alive()
            if self.cause is None and not self._interrupts:
                # (after a Ctrl-C every rank was asked to stop: one that ended, with 130 or with the
                # error of a peer gone, is no failure to stop the others for; they keep their time
                # to stop, a checkpoint write to finish, until a second Ctrl-C)
                failed = [i for i, p in enumerate(self.procs) if p.exitcode not in (None, 0, PREEMPTED_EXIT_CODE)]
                if failed:
                    self._seen_failed = failed
                    self.cause = self._first_failure(failed)
                    self._signalled_at = time.monotonic()
                    self.send(signal.SIGINT)  # unwinds python in the survivors; a rank blocked in C gets SIGKILL
            elif self.cause is not None and alive and time.monotonic() - (self._signalled_at or 0.0) > KILL_GRACE_SECONDS:
                self._kill_alive()
            if alive and self._interrupts and self._stop_interrupted():
                continue
            if not alive:
                break
            time.sleep(0.05)
        for p in self.procs:
            p.join()

    def _stop_interrupted(self) -> bool:
        """After a Ctrl-C: say how to stop at once; after a second one, SIGKILL the ranks still
        running (a rank blocked in C code never sees the first). True when it killed them.

        No timer does it: a rank finishing its checkpoint write may take a while."""
        if not self._said_how_to_kill:
            self._said_how_to_kill = True
            log.warning("stopping the ranks (Ctrl-C again to kill them now)")
        if len(self._interrupts) < 2:
            return False
        waited = time.monotonic() - self._interrupts[0]
        log.warning("killing %d rank(s) still running %.0f s after Ctrl-C", len(self.alive()), waited)
        self._kill_alive()
        return True

    def _first_failure(self, failed: List[int]) -> int:
        """Among ranks ``failed`` (seen failed in the same poll, or ended with an error file), the one
        that failed first.

        A rank killed from outside (no error file, e.g. by the OOM killer) comes first: the
        others' errors (a peer closed the connection) are its consequence.
        """
        stamps = {i: self._read_error(i)[0] for i in failed}
        return min(failed, key=lambda i: (stamps[i] is not None, stamps[i] or 0.0, i))

    def stop_for_preemption(self, timeout_s: float) -> bool:
        """Ask the ranks to checkpoint and stop (SIGUSR1), wait up to ``timeout_s``; True if they all ended."""
        if not self.procs:
            return True
        self.send(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self.alive()

    def _kill_alive(self) -> None:
        for p in self.alive():
            self._killed.add(self.procs.index(p))
            _kill_group(p.pid)
        for p in self.procs:
            p.join(timeout=5)

    def _end_leftovers(self) -> None:
        """SIGKILL what is left of each rank's process group (dataloader workers of a rank that
        ended without shutting them down); they would otherwise linger until their watchdog fires."""
        for p in self.procs:
            if p.pid:
                _kill_group(p.pid, only_group=True)

    # -- reporting --------------------------------------------------------------------------

    def _read_error(self, index: int) -> Tuple[Optional[float], int, str]:
        """(time, exit code, text) a rank left in its error file, or (None, 0, '')."""
        rank = self.node_id * self.nproc + index
        f = Path(self._error_dir, f"rank{rank}.err")
        try:
            stamp, code, text = f.read_text().split("\n", 2)
            return float(stamp), int(code), text
        except (OSError, ValueError):
            return None, 0, ""

    def _report(self) -> int:
        """The node's exit code; prints the failing rank's traceback (or raises its UserError)."""
        codes = [p.exitcode for p in self.procs]
        if self._interrupts and any(codes):  # what ranks did after a Ctrl-C is its consequence
            sys.stderr.write("interrupted\n")
            return INTERRUPTED_EXIT_CODE
        if self.cause is None:
            if all(c == 0 for c in codes):
                return 0
            if all(c in (0, PREEMPTED_EXIT_CODE) for c in codes):
                _, _, text = next(self._read_error(i) for i, c in enumerate(codes) if c == PREEMPTED_EXIT_CODE)
                log.warning("%s", text.strip() or "stopped on a preemption signal")
                return PREEMPTED_EXIT_CODE
        if self.cause is not None:
            # decided again now that every rank has ended and written its error file: the rank that
            # failed first may still have been exiting (closing its connections, which made the
            # others fail) when the poll saw another rank's exit. A rank without an error file (a
            # signal) counts only if that poll saw it: one that died later is a consequence
            ended = [i for i, c in enumerate(codes) if c not in (0, PREEMPTED_EXIT_CODE) and i not in self._killed
                     and (i in self._seen_failed or self._read_error(i)[0] is not None)]
            self.cause = self._first_failure(ended) if self.cause in ended else self.cause
        index = self.cause if self.cause is not None else next(i for i, c in enumerate(codes) if c != 0)
        rank = self.node_id * self.nproc + index
        _, code, text = self._read_error(index)
        exitcode = codes[index]
        if exitcode == USER_ERROR_EXIT_CODE and text:
            raise UserError(f"rank {rank}: {text.strip()}" if self.world > 1 else text.strip())
        if text.startswith(_NON_FINITE_MARK):
            message = text[len(_NON_FINITE_MARK):].strip()
            raise NonFiniteLossError(f"rank {rank}: {message}" if self.world > 1 else message)
        if exitcode == INTERRUPTED_EXIT_CODE:
            sys.stderr.write("interrupted\n")
            return INTERRUPTED_EXIT_CODE
        worker = killed_worker_line(text) if text else None
        if worker is not None:
            sys.stderr.write(f"error: rank {rank}: {worker}\n")
            return 1
        if text:
            sys.stderr.write(f"rank {rank} failed first (exit code {exitcode}):\n{text.rstrip()}\n")
            return exitcode if exitcode and exitcode > 0 else 1
        if exitcode is not None and exitcode < 0:
            name = signal.Signals(-exitcode).name
            hint = " (out of memory?)" if -exitcode == signal.SIGKILL else ""
            sys.stderr.write(f"rank {rank} was killed by {name}{hint}; the other ranks were stopped\n")
        else:
            sys.stderr.write(f"rank {rank} ended with exit code {exitcode}; the other ranks were stopped\n")
        return 1

    def _cleanup(self, rdzv_dir: Optional[str]) -> None:
        from ssl_engine.lock import EXTRACT_LOCK_NAME, LOCK_NAME

        pids = [p.pid for p in self.procs if p.pid]
        for folder in run_folders(self.cfg):
            remove_temp_files_of(folder, pids)
            for name in (LOCK_NAME, EXTRACT_LOCK_NAME):
                release_lock_of(folder, pids, name)
        from ssl_engine.data.loader import remove_unsent_batch_files

        remove_unsent_batch_files(pids)
        for folder in (self._error_dir, rdzv_dir):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)


def _kill_group(pid: int, only_group: bool = False) -> None:
    """SIGKILL the process group a rank leads (the rank and its workers), else the rank alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
        return
    except (ProcessLookupError, PermissionError):
        pass
    if not only_group:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_folders(cfg: AttrDict) -> List[Path]:
    """The folders a run's ranks write temporary files and hold a lock in: CHECKPOINT.DIR, and
    EXTRACT_FEATURES.OUTPUT_DIR where it names another folder (the extract_features engine's
    shards and extract.lock)."""
    folders = [Path(str(cfg.CHECKPOINT.DIR)).expanduser()]
    features = str(cfg.get("EXTRACT_FEATURES", {}).get("OUTPUT_DIR", "") or "")
    if features and Path(features).expanduser() != folders[0]:
        folders.append(Path(features).expanduser())
    return folders


def remove_temp_files_of(folder: Path, pids: List[int]) -> List[str]:
    """Remove the temporary files (``.<name>.tmp.<pid>``, see ssl_engine.checkpoint.atomic_write)
    that the ranks ``pids`` left in ``folder`` when they were killed mid-write.

    Only our own ranks' files: on a shared folder another node's writer may be at work.
    """
    removed: List[str] = []
    suffixes = tuple(f".tmp.{pid}" for pid in pids)
    if not suffixes or not folder.is_dir():
        return removed
    for f in folder.iterdir():
        if f.name.startswith(".") and f.name.endswith(suffixes):
            try:
                f.unlink()
                removed.append(f.name)
            except OSError:
                pass
    return removed


def release_lock_of(folder: Path, pids: List[int], name: str = "") -> bool:
    """Remove the lock ``name`` of ``folder`` (ssl_engine.lock; default: a checkpoint folder's)
    when one of our killed ranks held it."""
    from ssl_engine.lock import LOCK_NAME, lock_path

    path = lock_path(folder, name or LOCK_NAME)
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname() or owner.get("pid") not in pids:
        return False
    try:
        os.kill(int(owner["pid"]), 0)
        return False  # still running (cannot happen once we waited for our ranks)
    except ProcessLookupError:
        pass
    try:
        path.unlink()
    except OSError:
        return False
    return True


def short_sockets_if_needed(cfg: AttrDict, spawns_ranks: bool) -> None:
    """Before any loader worker or forkserver binds a socket: multiprocessing's socket folder
    short enough for Linux (ssl_engine.socket_dir); ranks and workers inherit it."""
    if int(cfg.DATA.NUM_DATALOADER_WORKERS) > 0 or (spawns_ranks and cfg.MULTI_PROCESSING_METHOD == "forkserver"):
        ensure_short_socket_dir()


def spawn_ranks(cfg: AttrDict, node_id: int = 0) -> int:
    """Start NUM_PROC_PER_NODE ranks of node ``node_id`` and wait; returns the node's exit code."""
    return RankGroup(cfg, node_id).run()


# ---------------------------------------------------------------------------- entry point


def set_nccl_env(cfg: AttrDict) -> None:
    """DISTRIBUTED.NCCL_DEBUG (NCCL_DEBUG=INFO) and NCCL_SOCKET_NTHREADS, as VISSL sets them, for
    the ranks this process starts (they inherit its environment). A variable the environment
    already sets is left as it is: the user's shell wins."""
    d = cfg.DISTRIBUTED
    if d.get("NCCL_DEBUG"):
        os.environ.setdefault("NCCL_DEBUG", "INFO")
    threads = d.get("NCCL_SOCKET_NTHREADS")
    if threads in (None, ""):
        return
    try:
        n = int(str(threads))
    except ValueError:
        n = 0
    if not 1 <= n <= 16:
        raise ConfigError(f"config.DISTRIBUTED.NCCL_SOCKET_NTHREADS={threads!r} must be an integer from 1 to 16 "
                          f"(NCCL's range), or empty to leave NCCL's default")
    os.environ.setdefault("NCCL_SOCKET_NTHREADS", str(n))


def launch(cfg: AttrDict, node_id: int = 0) -> int:
    """Run ``cfg`` as asked by its DISTRIBUTED / SLURM settings; returns the exit code."""
    check_devices(cfg)
    set_nccl_env(cfg)
    if cfg.SLURM.USE_SLURM:
        from ssl_engine.slurm import submit

        return submit(cfg)
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    short_sockets_if_needed(cfg, spawns_ranks=world > 1 and not under_torchrun())
    if under_torchrun():
        return run_under_torchrun(cfg)
    if not 0 <= node_id < cfg.DISTRIBUTED.NUM_NODES:
        raise ConfigError(
            f"node_id={node_id} is out of range for config.DISTRIBUTED.NUM_NODES={cfg.DISTRIBUTED.NUM_NODES} "
            f"(valid: 0..{cfg.DISTRIBUTED.NUM_NODES - 1})"
        )
    if world == 1:
        return _in_process(cfg, RankInfo(backend=backend_for(cfg)))
    return spawn_ranks(cfg, node_id)


def run_under_torchrun(cfg: AttrDict) -> int:
    """One rank that torchrun started: env:// rendezvous; torchrun's WORLD_SIZE wins over the config.

    The config's NUM_NODES / NUM_PROC_PER_NODE are replaced by what torchrun set up (so the
    saved train_config.yaml tells the truth), with a warning on rank 0 when they differ.
    """
    info = env_rank_info()
    info.backend = backend_for(cfg)
    d = cfg.DISTRIBUTED
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", d.NUM_PROC_PER_NODE))
    nodes = max(1, info.world_size // max(1, local_world))
    if (d.NUM_NODES, d.NUM_PROC_PER_NODE) != (nodes, local_world) and info.rank == 0:
        log.warning(
            "torchrun started %d rank(s) (%d node(s) x %d): its WORLD_SIZE=%d wins over the config's "
            "DISTRIBUTED.NUM_NODES=%d x NUM_PROC_PER_NODE=%d",
            info.world_size, nodes, local_world, info.world_size, d.NUM_NODES, d.NUM_PROC_PER_NODE,
        )
    d.NUM_NODES, d.NUM_PROC_PER_NODE, d.INIT_METHOD = nodes, local_world, "env"
    if cfg.MACHINE.DEVICE == "gpu":
        import torch

        if info.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"torchrun's LOCAL_RANK={info.local_rank} has no GPU (this machine has {torch.cuda.device_count()}); "
                "lower --nproc_per_node"
            )
    try:
        return _in_process(cfg, info)
    except Exception as e:
        # torchrun's summary shows the traceback of the rank that failed first
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        if not isinstance(e, UserError):
            ErrorHandler().record_exception(e)
        raise


def _in_process(cfg: AttrDict, info: RankInfo) -> int:
    from ssl_engine.engines import run_engine
    from ssl_engine.preemption import Preempted

    try:
        run_engine(cfg, info)
    except Preempted as e:
        log.warning("%s", e)
        return PREEMPTED_EXIT_CODE
    return 0
