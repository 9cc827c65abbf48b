"""The command line of tools/run_distributed_engines.py.

Everything the user can get wrong is checked before any process starts, where it can be:
the config (keys, types, ranges, registry names), the files it names (data, weights,
checkpoints), the parts it builds (datasets, loaders, model dimensions, optimizer; built on
the meta device, no image decoded) and the checkpoint folder (writable, not locked by
another run). A user error ends in one line on stderr, ``error: ...``, and exit code 2,
without a traceback; ``--debug`` or ``SSL_ENGINE_DEBUG=1`` shows the traceback. The same
holds for user errors raised later in a rank or a dataloader worker: the launcher and torch
pass them up and the original message is printed. A non-finite loss stops the run with one
line and exit code 1; Ctrl-C with exit code 130.

Startup: the tool's process forks a child that composes the config while the process itself
imports torch, and a config mistake is reported as soon as composing fails (about a second);
a library call composes first and imports torch only after. A one-process run trains in this
process (ssl_engine.launch); where loader workers or ranks will come from a forkserver, it is
started as soon as the config has composed so that its imports overlap this process's own.
"""

import builtins
import contextlib
import logging
import os
import re
import sys
import warnings
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ssl_engine.errors import (
    INTERRUPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    NonFiniteLossError,
    UserError,
    file_system_error,
    killed_worker_line,
    one_line,
    quiet_killed_worker_echoes,
)

log = logging.getLogger("ssl_engine")

RUN_FAILED_EXIT_CODE = 1

_OVERRIDES_HELP = """  config=NAME           NAME.yaml under $SSL_ENGINE_CONFIG_DIR/config, ./configs/config or the package's
                        configs/config; or config=/path/to/file.yaml
  config.A.B=value      set a key of ssl_engine/config/defaults.yaml
  +config.A.NEW=value   add a key the defaults lack (options of your own parts)
  ~config.A.B           drop a key from the composed config (it takes its default)
  +config/GROUP=NAME    merge GROUP/NAME.yaml of a config folder over the experiment
  node_id=K             this machine's index in a multi-node job (default 0)"""

RUN_USAGE = f"""usage: run_distributed_engines.py config=<name or file.yaml> [override ...] [node_id=K]
                                 [--engine=train|extract_features] [--debug]

Compose the config, check it, and run its engine (engine_name: train or extract_features).

{_OVERRIDES_HELP}
  --engine=NAME         the engine to run, as engine_name=NAME
  --debug               show the traceback of a user error (or set SSL_ENGINE_DEBUG=1)"""

KNN_USAGE = f"""usage: nearest_neighbor_test.py config=<name or file.yaml> [override ...] [node_id=K] [--debug]

kNN top-1 / top-5 of extracted features. With config.NEAREST_NEIGHBOR.FEATURES.PATH empty it first
extracts the TRAIN and TEST features of the config's model (the extract_features engine), then
reads them from config.EXTRACT_FEATURES.OUTPUT_DIR (default config.CHECKPOINT.DIR); with a PATH it
only reads that folder. Options: config.NEAREST_NEIGHBOR.{{TOPK, SIGMA, TOPK_LIST, L2_NORM_FEATS,
TEST_CHUNK_SIZE}}.

{_OVERRIDES_HELP}
  --debug               show the traceback of a user error (or set SSL_ENGINE_DEBUG=1)"""


# hydra's own command-line flags (of an @hydra.main script), and what to use instead: the tools
# compose the config with hydra's compose API, as VISSL's do, so none of them would act
_HYDRA_FLAGS_INSTEAD = {
    ("-m", "--multirun"): "the tool runs one config (no sweeps): run it once per value, each with its own "
                          "config.CHECKPOINT.DIR",
    ("-c", "--cfg", "--resolve"): "config.VERBOSE=true logs the composed config at start, and a run writes it "
                                  "to config.CHECKPOINT.DIR/train_config.yaml",
    ("-i", "--info"): "config.VERBOSE=true logs the composed config at start (see --help for the config search path)",
    ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"):
        "name the experiment with config=NAME or config=/path/to/file.yaml; add config folders with "
        "$SSL_ENGINE_CONFIG_DIR",
    ("-p", "--package"): "experiment files start with '# @package _global_' and put options under config:",
    ("-r", "--run", "--hydra-help", "-sc", "--shell-completion", "--experimental-rerun"):
        "see --help for what the tool takes (config=CHECKPOINT.DIR/train_config.yaml runs a run's config again)",
}


def _hydra_flag_line(arg: str) -> Optional[str]:
    """The one line for hydra's flag ``arg`` (``-m``, ``--cfg=job``, ...), or None for another option."""
    flag = arg.split("=", 1)[0]
    for flags, instead in _HYDRA_FLAGS_INSTEAD.items():
        if flag in flags:
            return (f"{flag} is a flag of hydra's own command line, which the tool does not have (it composes "
                    f"the config with hydra's compose API, not @hydra.main); {instead}")
    return None


def print_usage(usage: str) -> None:
    """Print a tool's ``--help`` text. A reader that closed the pipe after the lines it wanted
    (``--help | head -1``) ends the write quietly: stdout then points to os.devnull, so neither
    this print nor the interpreter's last flush prints a BrokenPipeError traceback."""
    try:
        print(usage, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _split_args(argv: List[str], usage: str = RUN_USAGE, engine_option: bool = True) -> Tuple[List[str], int, bool]:
    """(hydra overrides, node_id, debug) from the command line; ``--help`` prints ``usage`` and
    exits; ``--engine=NAME`` is an option only where ``engine_option`` (a tool that runs one
    engine itself, as the kNN test, refuses it)."""
    if not argv:  # the defaults alone name no data: their first error would be DATA_SOURCES, not this
        raise UserError("no arguments: name an experiment with config=NAME or config=/path/to/file.yaml, "
                        "e.g. config=quick/simclr_digits (--help lists the forms of override)")
    overrides, node_id, debug, engine = [], 0, False, None
    for i, a in enumerate(argv):
        if a == "--engine" and engine_option:  # argparse's spelling: the name as the next word
            after = argv[i + 1] if i + 1 < len(argv) and "=" not in argv[i + 1] else "NAME"
            raise UserError(f"write the engine as one word, --engine={after} (the option takes its name after '=')")
        if a in ("--debug", "-d"):
            debug = True
        elif a.startswith("node_id="):
            try:
                node_id = int(a.split("=", 1)[1])
            except ValueError:
                raise UserError(f"node_id={a.split('=', 1)[1]!r} is not an integer") from None
        elif a.startswith("--engine=") and engine_option:
            engine = a.split("=", 1)[1]
        elif a in ("-h", "--help"):
            print_usage(usage)
            sys.exit(0)
        elif a.startswith("-"):
            hydra_flag = _hydra_flag_line(a)
            if hydra_flag is not None:
                raise UserError(hydra_flag)
            options = "--engine=NAME, --debug, --help" if engine_option else "--debug, --help"
            raise UserError(f"unknown option {a!r}; options are {options} (see --help)")
        else:
            overrides.append(a)
    if engine is not None:  # --engine= too: an empty name is refused with the known ones, not dropped
        overrides.append(f"engine_name={engine}")
    return overrides, node_id, debug


# warnings of dependencies that a user can do nothing about, as PYTHONWARNINGS entries (action,
# start of the message, category): import-time deprecation notices of torchvision and torch, and
# the resource tracker's count of semaphores that ranks or loader workers ended by an error left,
# and torch's loader worker count warning, which it repeats for every iterator of every rank
_QUIET_WARNINGS = (
    "ignore:The 'torchvision.transforms._functional_video' module",
    "ignore:The 'torchvision.transforms._transforms_video' module",
    "ignore:`torch.jit.script` is deprecated:FutureWarning",
    "ignore:resource_tracker",
    "ignore:This DataLoader will create",  # said once before launch instead (data.loader.worker_count_note)
)


def quiet_dependency_warnings() -> None:
    """Hide warnings of dependencies that a user can do nothing about, in this process and in
    every process it starts (spawned or forkserver ranks, loader workers, the forkserver and
    multiprocessing's resource tracker import torchvision, or report, on their own): the
    filters are added to PYTHONWARNINGS, which each new interpreter reads before any import."""
    for entry in _QUIET_WARNINGS:
        action, message, *category = entry.split(":")
        warnings.filterwarnings(action, message=re.escape(message),
                                category=getattr(builtins, category[0]) if category else Warning)
    given = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(given + [e for e in _QUIET_WARNINGS if e not in given])


def start_forkserver_early(cfg) -> None:
    """Start now, with torch and the data modules preloaded, the forkserver that this process's
    loader workers (or the ranks it spawns) will be forked from.

    Started here, right after the config composed, the forkserver's imports run in another
    process while this one imports its own, instead of after them, when the first batch is
    asked for. Only where a forkserver will be used: MULTI_PROCESSING_METHOD=forkserver, and
    loader workers or ranks started by this process; never for a SLURM submission. On a user
    error found later the forkserver ends by itself once this process has exited.
    """
    if cfg.SLURM.USE_SLURM or cfg.MULTI_PROCESSING_METHOD != "forkserver":
        return
    world = int(cfg.DISTRIBUTED.NUM_NODES) * int(cfg.DISTRIBUTED.NUM_PROC_PER_NODE)
    spawns_ranks = world > 1 and "RANK" not in os.environ  # torchrun's ranks run in-process
    if int(cfg.DATA.NUM_DATALOADER_WORKERS) <= 0 and not spawns_ranks:
        return
    import tempfile
    from multiprocessing import forkserver

    from ssl_engine.forkserver import preload_forkserver
    from ssl_engine.socket_dir import socket_path_fits

    if not socket_path_fits(tempfile.gettempdir()):
        return  # its socket could not bind there: launch() moves the sockets first, in the main thread
    preload_forkserver()
    try:
        forkserver.ensure_running()
    except OSError as e:  # no forkserver now: workers will start one when they need it
        log.debug("could not start the forkserver early: %s", e)


def prepare_config(overrides: List[str], tool_process: bool = False,
                   checked: Optional[Callable[[Any], Any]] = None):
    """Compose, import user modules, and check names and paths: the cheap checks, which need no
    model or data.

    ``checked(cfg)`` gives the part of the config the command builds and reads, whose registry
    names and data paths are checked (None: nothing of it, e.g. a kNN test of features already
    on disk); by default the whole config less an extraction's left-out splits.

    In a library call torch is imported only once the config has composed. In the tool's own
    process (``tool_process``) a forked child composes the config while this process imports
    torch (ssl_engine.config.forked_compose), and a config mistake still ends the process with
    its one-line error as soon as composing fails.
    """
    from ssl_engine.config import compose, forked_compose
    from ssl_engine.logger import setup_logging

    setup_logging(0, None)
    pending = forked_compose.start(overrides, on_config=start_forkserver_early, exit_on_user_error=True) \
        if tool_process else None
    if pending is None:
        cfg = compose(overrides)
        start_forkserver_early(cfg)

    from ssl_engine.config.validate import (
        check_data_paths, check_no_head_mapping, check_registered_names, without_unextracted_splits,
    )
    from ssl_engine.user_modules import import_user_modules

    try:
        from ssl_engine.engines.run import load_builtin_parts  # imports torch

        load_builtin_parts()
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        cfg = pending.result()
    import_user_modules(cfg.USER_MODULES)
    used = without_unextracted_splits(cfg) if checked is None else checked(cfg)  # an extraction's left-out splits are not checked
    if used is not None:
        check_registered_names(used)
        check_no_head_mapping(used)
        check_data_paths(used)
    return cfg


def check_working_folder() -> None:
    """The folder the command runs in still exists. A shell left in a folder that was then deleted
    (a run folder removed to start again) gives a process whose working folder is gone: importing
    torch there ended the process with MKL's "FATAL ERROR: Cannot load libtorch_cpu.so", exit 2,
    and relative paths and ./configs/config would name nothing."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise UserError("the current folder no longer exists (it was deleted after this shell entered it); "
                        "cd to an existing folder and run the command again") from None


def world_size_of(cfg) -> int:
    """The number of ranks the run will have (torchrun's WORLD_SIZE wins when it is set)."""
    from ssl_engine.distributed import env_rank_info
    from ssl_engine.launch import under_torchrun

    if under_torchrun():
        return env_rank_info().world_size  # checked: WORLD_SIZE=x is one line, not a ValueError
    return int(cfg.DISTRIBUTED.NUM_NODES) * int(cfg.DISTRIBUTED.NUM_PROC_PER_NODE)


def check_before_launch(cfg, node_id: int = 0) -> None:
    """What each rank would find out only after starting: output folders, the checkpoint
    folder's lock, the checkpoint to resume from, and the parts built on the meta device."""
    from ssl_engine.config.validate import (
        check_hook_output_folders, check_output_folder, check_parts_build, check_pointer_is_not_a_folder,
        check_resume_file,
    )
    from ssl_engine.launch import check_torchrun_env, under_torchrun
    from ssl_engine.lock import EXTRACT_LOCK_NAME, check_folder_free

    check_torchrun_env()
    check_output_folder(cfg.CHECKPOINT.DIR, "config.CHECKPOINT.DIR")
    if cfg.SLURM.USE_SLURM:
        from ssl_engine.slurm import log_folder

        logs = log_folder(cfg)  # up to its first part with submitit's %j (the job id): made at submission
        check_output_folder(next((p for p in (logs, *logs.parents) if "%" not in str(p)), logs), "config.SLURM.LOG_FOLDER")
    if cfg.engine_name == "extract_features" and cfg.EXTRACT_FEATURES.OUTPUT_DIR:
        check_output_folder(cfg.EXTRACT_FEATURES.OUTPUT_DIR, "config.EXTRACT_FEATURES.OUTPUT_DIR")
    if cfg.engine_name == "train" and node_id == 0 and not under_torchrun():
        # ranks started by torchrun, and other nodes, would see rank 0's own lock
        check_folder_free(cfg.CHECKPOINT.DIR)
    if cfg.engine_name == "train":
        check_pointer_is_not_a_folder(cfg.CHECKPOINT.DIR)
        check_hook_output_folders(cfg)
    if cfg.engine_name == "extract_features" and node_id == 0 and not under_torchrun():
        check_folder_free(cfg.EXTRACT_FEATURES.OUTPUT_DIR or cfg.CHECKPOINT.DIR, EXTRACT_LOCK_NAME)
    with one_thread_in_this_process():
        check_resume_file(cfg)
        check_parts_build(cfg, world_size_of(cfg))


@contextlib.contextmanager
def one_thread_in_this_process() -> Iterator[None]:
    """torch ops on one thread while the tool process checks the config. With more, a large op
    (the weights file's finite check) starts OpenMP's thread team in this process, and a rank
    forked from it (MULTI_PROCESSING_METHOD: fork) then waits forever on that team's barrier at
    its first parallel op. The team is only made by a parallel op, so none exists afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_command(argv: Optional[List[str]], body: Callable[[Any, int], int], tool_process: bool = False,
                checked: Optional[Callable[[Any], Any]] = None, usage: str = RUN_USAGE,
                engine_option: bool = True) -> int:
    """A command line tool's frame: parse ``config=... key=value`` arguments, compose and check
    the config, run ``body(cfg, node_id)``, and turn user errors into one line and exit code 2
    (a non-finite loss: exit 1; Ctrl-C: 130). ``--debug`` or SSL_ENGINE_DEBUG=1 keeps tracebacks.

    ``tool_process``: this process is the command's own, started to run it and end (the tools'
    ``__main__``), not a caller that goes on afterwards: composing may then overlap importing
    torch, and a config mistake may end the process directly (see prepare_config). ``checked``:
    the part of the config whose names and paths are checked (see prepare_config). ``usage``: the
    tool's ``--help`` text; ``engine_option``: whether the tool takes ``--engine=NAME``."""
    code = RUN_FAILED_EXIT_CODE  # an exception out of the command (a bug) ends the process with 1
    if tool_process:
        import atexit

        # registered before torch and multiprocessing register theirs, so it runs after them (atexit
        # runs the last registered first): the last Python code of the process
        atexit.register(_ignore_ctrl_c_from_now)
    try:
        code = _run_command(argv, body, tool_process, checked, usage, engine_option)
        return code
    finally:
        if tool_process:  # the command has ended: its exit code must survive the process's shutdown
            from ssl_engine import preemption

            preemption.ignore_from_now()
            _exit_at_once_on_ctrl_c(code)


def _run_command(argv: Optional[List[str]], body: Callable[[Any, int], int], tool_process: bool,
                 checked: Optional[Callable[[Any], Any]] = None, usage: str = RUN_USAGE,
                 engine_option: bool = True) -> int:
    from ssl_engine import startup_gc

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("SSL_ENGINE_DEBUG", "") not in ("", "0")
    try:
        with startup_gc.paused(tool_process):  # from the first import until the last (see startup_gc)
            from ssl_engine import preemption

            preemption.install()  # a preemption signal during startup is kept for the first step, not fatal
            quiet_killed_worker_echoes()
            quiet_dependency_warnings()
            overrides, node_id, flag = _split_args(argv, usage, engine_option)
            debug = debug or flag
            check_working_folder()
            cfg = prepare_config(overrides, tool_process=tool_process and not debug, checked=checked)
        return body(cfg, node_id)
    except UserError as e:
        _report(e, debug)
        return USER_ERROR_EXIT_CODE
    except NonFiniteLossError as e:
        _report(e, debug)
        return RUN_FAILED_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except Exception as e:
        file_error = file_system_error(e)
        if file_error is not None:
            _report(file_error, debug)
            return USER_ERROR_EXIT_CODE
        import traceback

        worker = killed_worker_line("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        if worker is not None:
            _report(RuntimeError(worker), debug)
            return RUN_FAILED_EXIT_CODE
        if debug or not _raised_while_interrupted(e):
            raise
        # Ctrl-C landed inside library code that then failed on its way out (e.g. a thread
        # pool's lock released twice): the run was interrupted, not broken
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _report(error: BaseException, debug: bool) -> None:
    """The error's one line on stderr; with --debug the traceback of the exception being
    handled first (the exit code stays the one the error has without it)."""
    if debug:
        import traceback

        traceback.print_exc()
    print(f"error: {one_line(str(error))}", file=sys.stderr)


def _exit_at_once_on_ctrl_c(code: int) -> None:
    """Ctrl-C after the command has ended (during Python's shutdown: joining threads, atexit
    functions of torch and multiprocessing) ends the process at once with the command's exit
    ``code``, instead of a KeyboardInterrupt traceback out of whichever atexit function it landed
    in. Everything the command writes is on disk by then."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    signal.signal(signal.SIGINT, leave)


def _ignore_ctrl_c_from_now() -> None:
    """After the last atexit function, Python's shutdown puts SIGINT back to its default action
    (no Python code can run any more), so a Ctrl-C in the process's last milliseconds would end
    it as killed by SIGINT (exit status 130) although the command had finished with its own code.
    Ignoring SIGINT from here on keeps that code; Python leaves an ignored signal ignored."""
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread, or no signals here
        pass


def _raised_while_interrupted(error: BaseException) -> bool:
    """Whether ``error`` was raised while a KeyboardInterrupt was being handled."""
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__context__
    return False


def _launch(cfg: Any, node_id: int) -> int:
    check_before_launch(cfg, node_id)
    from ssl_engine.launch import launch

    return launch(cfg, node_id=node_id)


def main(argv: Optional[List[str]] = None, tool_process: bool = False) -> int:
    """tools/run_distributed_engines.py: compose, check, launch the configured engine
    (``tool_process``: see run_command)."""
    return run_command(argv, _launch, tool_process=tool_process)
