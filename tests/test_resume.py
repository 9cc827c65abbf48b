"""Exact resume: kill a run at any instant, rerun the same command, get the same model bit for bit."""

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import REPO, TOOL, assert_bitwise_equal, classy_state, run_tool, tool_env

KILLER = '''
"""Test module: kill or signal this process at a chosen point (env SSL_TEST_KILL=event:number)."""
import os, signal
import ssl_engine.checkpoint as ck
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS, DATA_SOURCES
from ssl_engine.data.sources import SyntheticSource

event, _, num = os.environ.get("SSL_TEST_KILL", "").partition(":")
num = int(num) if num else -1


@HOOKS.register("KillAt")
class KillAt(SSLHook):
    priority = 95  # after the checkpoint hook

    def on_step(self, task):
        if event == "step" and task.iteration == num:
            os.kill(os.getpid(), signal.SIGKILL)
        if event == "term" and task.iteration == num:
            os.kill(os.getpid(), signal.SIGTERM)
        if event == "worker" and task.iteration == num and task.rank == 0:
            # what torch raises when the kernel's OOM killer ended a loader worker (a real kill races
            # with the batches in flight: the error can come from another place first)
            raise RuntimeError(f"DataLoader worker (pid {os.getpid() + 1}) is killed by signal: Killed. ")
        if event == "group_term" and task.iteration == num and task.rank == 0:
            # the tool's process group, as a scheduler or `timeout` signals a job (the tool runs as a
            # session leader; a rank is a group of its own in that session)
            os.killpg(os.getsid(0), signal.SIGTERM)

    def on_phase_end(self, task):
        if event == "phase_end" and task.phase_idx == num:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_update(self, task):
        if event == "rmtree" and task.iteration + 1 == num:  # the folder is deleted by hand mid-run
            import shutil
            while os.path.lexists(task.checkpoint_folder):  # a background write may add or drop a file meanwhile
                shutil.rmtree(task.checkpoint_folder, ignore_errors=True)


if event == "handover":  # a worker killed while it hands the num-th batch over (the race a real kill can hit)
    from torch.utils.data import dataloader as _dl

    _orig_get, _gets = _dl._MultiProcessingDataLoaderIter._try_get_data, [0]

    def _try_get_data(self, *args, **kwargs):
        _gets[0] += 1
        if _gets[0] == num:
            raise ConnectionResetError(104, "Connection reset by peer")  # what the cut socket gives
        return _orig_get(self, *args, **kwargs)

    _dl._MultiProcessingDataLoaderIter._try_get_data = _try_get_data


if event == "save":  # die in the middle of writing the num-th checkpoint file
    _orig, _count = ck.atomic_write, [0]

    def atomic_write(path, write, mode="wb"):
        if str(path).endswith(".torch"):
            _count[0] += 1
            if _count[0] == num:
                def partial(f):
                    f.write(b"PK\\x03\\x04partial")
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return _orig(path, partial, mode)
        return _orig(path, write, mode)

    ck.atomic_write = atomic_write


if event == "set_aside":  # die right after the num-th file moved into previous_run.N
    _replace, _moves = os.replace, [0]

    def replace(src, dst, *args, **kwargs):
        _replace(src, dst, *args, **kwargs)
        if os.path.basename(os.path.dirname(str(dst))).startswith("previous_run."):
            _moves[0] += 1
            if _moves[0] == num:
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace


@DATA_SOURCES.register("counted_synthetic")
class CountedSynthetic(SyntheticSource):
    """The synthetic source, logging every index it reads to $SSL_TEST_READS."""

    def get(self, idx):
        log = os.environ.get("SSL_TEST_READS")
        if log:
            with open(log, "a") as f:
                f.write(f"{self.split} {idx}\\n")
        return super().get(idx)
'''

CONFIG = """# @package _global_
config:
  LOG_FREQUENCY: 1
  TEST_MODEL: true
  MULTI_PROCESSING_METHOD: fork
  USER_MODULES: [{module}]
  HOOKS:
    CUSTOM: [{{name: KillAt}}]
  DATA:
    NUM_DATALOADER_WORKERS: 0
    PIN_MEMORY: false
    TRAIN:
      DATA_SOURCES: [counted_synthetic]
      LABEL_SOURCES: [counted_synthetic]
      DATA_LIMIT: 48
      SYNTHETIC_IMAGE_SIZE: 8
      BATCHSIZE_PER_REPLICA: 8
      TRANSFORMS: [{{name: RandomResizedCrop, size: 8, scale: [0.5, 1.0]}}, {{name: RandomHorizontalFlip}}, {{name: ToTensor}}]
    TEST:
      DATA_SOURCES: [counted_synthetic]
      LABEL_SOURCES: [counted_synthetic]
      DATA_LIMIT: 20
      SYNTHETIC_IMAGE_SIZE: 8
      BATCHSIZE_PER_REPLICA: 8
      TRANSFORMS: [{{name: ToTensor}}]
  METERS:
    names: [accuracy_list_meter]
  MACHINE: {{DEVICE: cpu}}
  MODEL:
    TRUNK: {{NAME: mlp, MLP: {{DIMS: [192, 32], USE_BN: true}}}}
    HEAD: {{PARAMS: [[mlp, {{dims: [32, 10]}}]]}}
  LOSS: {{name: cross_entropy_multiple_output_single_target}}
  OPTIMIZER:
    name: sgd
    num_epochs: 3
    param_schedulers: {{lr: {{name: cosine, start_value: 0.1, end_value: 0.001, update_interval: step}}}}
  DISTRIBUTED: {{NUM_PROC_PER_NODE: 1}}
  CHECKPOINT: {{CHECKPOINT_ITER_FREQUENCY: 2}}
"""

ITERS_PER_EPOCH, EPOCHS = 6, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    module = root / "resume_killer.py"
    module.write_text(KILLER)
    cfg = root / "resume.yaml"
    cfg.write_text(CONFIG.format(module=module))
    return root, cfg


def run(cfg, folder, *extra, kill="", reads=None):
    env = {"SSL_TEST_KILL": kill}
    if reads:
        env["SSL_TEST_READS"] = str(reads)
    return run_tool([f"config={cfg}", f"config.CHECKPOINT.DIR={folder}", *extra], env=env)


def tensors_of(path):
    ck = torch.load(str(path), map_location="cpu", weights_only=True)["classy_state_dict"]
    return {"model": ck["base_model"], "optimizer": ck["optimizer"], "meters": ck["meters"]}


def losses(folder):
    """iteration -> (loss, avg_loss since the last line), as logged in stdout.json (once per
    iteration, also after a resume)."""
    out = {}
    for line in (Path(folder) / "stdout.json").read_text().splitlines():
        r = json.loads(line)
        out[r["iteration"]] = (r["loss"], r["avg_loss"])
    return out


@pytest.fixture(scope="module")
def reference(setup):
    """Uninterrupted runs with 0 and 2 loader workers."""
    root, cfg = setup
    refs = {}
    for workers in (0, 2):
        folder = root / f"ref_w{workers}"
        r = run(cfg, folder, f"config.DATA.NUM_DATALOADER_WORKERS={workers}")
        assert r.returncode == 0, r.stderr[-3000:]
        refs[workers] = folder
    return refs


def test_workers_do_not_change_the_result(reference):
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(reference[2] / "checkpoint.torch"))


@pytest.mark.parametrize("workers", [0, 2])
def test_killed_at_random_moments_resumes_bitwise(setup, reference, workers):
    root, cfg = setup
    seed = int(os.environ.get("SSL_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    total = ITERS_PER_EPOCH * EPOCHS
    # one kill inside a phase, one at a phase boundary, one in the middle of a checkpoint write
    kills = [f"step:{rng.randint(1, total // 2)}", f"phase_end:{rng.randint(0, 2 * EPOCHS - 2)}",
             f"save:{rng.randint(2, 8)}"]
    rng.shuffle(kills)
    folder = root / f"killed_w{workers}_{seed}"
    extra = [f"config.DATA.NUM_DATALOADER_WORKERS={workers}"]
    for kill in kills:
        r = run(cfg, folder, *extra, kill=kill)
        assert r.returncode == -signal.SIGKILL or r.returncode == 0, (kill, r.stderr[-3000:])
    # and one kill at a random instant in time
    proc = subprocess.Popen([sys.executable, TOOL, f"config={cfg}", f"config.CHECKPOINT.DIR={folder}", *extra],
                            cwd=str(REPO), env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(3.0, 6.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run(cfg, folder, *extra)
    assert r.returncode == 0, (seed, kills, r.stderr[-3000:])
    assert (folder / f"model_final_checkpoint_phase{EPOCHS - 1}.torch").exists()
    ref = reference[workers]
    assert_bitwise_equal(tensors_of(ref / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))
    assert losses(ref) == losses(folder), f"seed {seed} kills {kills}"
    assert not [p.name for p in folder.iterdir() if ".tmp." in p.name], "temporary files left behind"


def test_preemption_signal_checkpoints_and_exits_3(setup, reference):
    root, cfg = setup
    folder = root / "preempted"
    r = run(cfg, folder, kill="term:7")
    assert r.returncode == 3, r.stderr[-2000:]
    assert "preemption" in (r.stdout + r.stderr)
    assert (folder / "model_iteration8.torch").exists()  # written at the next step boundary
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_preemption_signal_during_startup_checkpoints_at_the_first_step(setup, reference, ranks):
    """SIGTERM while the tool still composes the config and imports torch: kept, not fatal."""
    root, cfg = setup
    folder = root / f"preempted_at_start_{ranks}"
    cmd = [sys.executable, str(TOOL), f"config={cfg}", f"config.CHECKPOINT.DIR={folder}"]
    if ranks == 2:
        cmd += ["config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=tool_env({"SSL_TEST_KILL": ""}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    assert proc.poll() is None, "the run ended before the signal"
    assert not folder.exists() or not list(folder.glob("model_*.torch")), "training started before the signal"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]
    assert [p.name for p in folder.glob("model_iteration*.torch")], out[-2000:]
    if ranks == 1:
        r = run(cfg, folder)
        assert r.returncode == 0, r.stderr[-2000:]
        assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preemption_signal_after_the_last_line_leaves_exit_0(setup, tmp_path, signum):
    """A scheduler's SIGTERM as a finished run shuts down (its files complete) must not make its
    exit code 'killed': Python's shutdown puts the default handlers back, so the tool ignores
    the preemption signals once the command has ended."""
    root, cfg = setup
    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(TOOL), f"config={cfg}", f"config.CHECKPOINT.DIR={folder}",
                             "config.TEST_MODEL=false", "config.OPTIMIZER.num_epochs=1"],
                            cwd=REPO, env=tool_env({"SSL_TEST_KILL": ""}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "total training time" in line:
            time.sleep(0.1)
            if proc.poll() is None:
                os.killpg(proc.pid, signum)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, "".join(lines)[-2000:] + rest[-2000:]
    assert (folder / "model_final_checkpoint_phase0.torch").exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_preemption_signal_to_the_process_group_checkpoints_with_forkserver_ranks(setup, tmp_path, workers):
    """SIGTERM to the whole process group (a scheduler, `timeout`) reaches the forkserver that
    forked the ranks and loader workers too: it must outlive the signal, or the launcher reads no
    exit status for the ranks, takes that for a failure and kills them before they checkpoint."""
    root, cfg = setup
    folder = tmp_path / "run"
    cmd = [sys.executable, str(TOOL), f"config={cfg}", f"config.CHECKPOINT.DIR={folder}",
           "config.MULTI_PROCESSING_METHOD=forkserver", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
           f"config.DATA.NUM_DATALOADER_WORKERS={workers}", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=-1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=tool_env({"SSL_TEST_KILL": "group_term:1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3, err[-3000:]
    assert "stopped on a preemption signal at iteration" in err + out, err[-3000:]
    written = [p.name for p in folder.glob("model_*.torch")]  # the ranks agree on the step to stop at
    assert len(written) == 1 and re.fullmatch(r"model_iteration[23]\.torch", written[0]), (written, out[-2000:])
    assert not (folder / "train.lock").exists()
    r = run(cfg, folder, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.MULTI_PROCESSING_METHOD=forkserver")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout + r.stderr


def test_a_run_killed_while_it_sets_an_earlier_run_aside_never_resumes_from_that_run(setup, reference, tmp_path):
    """A run from scratch (AUTO_RESUME=false) in a used folder moves the earlier run's files into
    previous_run.1, one rename each; killed among them it left the earlier run's checkpoints in
    the folder, and the rerun resumed from them. The rerun finishes the move and starts afresh."""
    root, cfg = setup
    folder = tmp_path / "run"
    r = run(cfg, folder, "config.CHECKPOINT.ASYNC_WRITE=false", kill="step:5")
    assert r.returncode == -signal.SIGKILL
    earlier = sorted(p.name for p in folder.glob("model_*.torch"))
    assert earlier == ["model_iteration2.torch", "model_iteration4.torch"], earlier
    r = run(cfg, folder, "config.CHECKPOINT.AUTO_RESUME=false", kill="set_aside:2")  # the pointer and metrics.json moved
    assert r.returncode == -signal.SIGKILL
    assert sorted(p.name for p in folder.glob("model_*.torch")) == earlier  # what the kill left behind
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout + r.stderr
    assert "resumed from" not in log, log[-3000:]
    assert re.search(r"previous_run\.1 left \d+ of them here: moved them there too", log), log[-3000:]
    assert sorted(p.name for p in (folder / "previous_run.1").glob("model_*.torch")) == earlier
    assert not (folder / "previous_run.2").exists()
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


def test_a_preempted_run_without_auto_resume_says_how_to_resume_it(setup, tmp_path):
    """With AUTO_RESUME=false the same command starts over (moving the preempted run aside): the
    exit-3 line names the RESUME_FROM that goes on instead of promising a resume."""
    root, cfg = setup
    folder = tmp_path / "run"
    r = run(cfg, folder, "config.CHECKPOINT.AUTO_RESUME=false", kill="term:3")
    assert r.returncode == 3, r.stderr[-2000:]
    m = re.search(r"stopped on a preemption signal at iteration (\d+); to resume, rerun with "
                  r"config\.CHECKPOINT\.RESUME_FROM=(\S+) \(the same command would not: "
                  r"config\.CHECKPOINT\.AUTO_RESUME=false\)", r.stdout + r.stderr)
    assert m, (r.stdout + r.stderr)[-2000:]
    assert m.group(2) == str(folder / f"model_iteration{m.group(1)}.torch") and Path(m.group(2)).is_file()
    r = run(cfg, folder, "config.CHECKPOINT.AUTO_RESUME=false", f"config.CHECKPOINT.RESUME_FROM={m.group(2)}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {m.group(2)}" in r.stdout + r.stderr


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("kill", ["worker:3", "handover:5"])
def test_a_killed_loader_worker_is_one_line_and_the_rerun_resumes(setup, tmp_path, ranks, kill):
    """torch's "DataLoader worker (pid N) is killed by signal: Killed." came out as a 47-line
    traceback: it is one line naming the worker, the likely cause and the way on (exit code 1), from
    the tool's own process and through the launcher. A kill that lands while the worker hands a
    batch over surfaces as the cut connection's ConnectionResetError instead: one line too."""
    root, cfg = setup
    folder = tmp_path / "run"
    args = ["config.DATA.NUM_DATALOADER_WORKERS=2", f"config.DISTRIBUTED.NUM_PROC_PER_NODE={ranks}"]
    r = run(cfg, folder, *args, kill=kill)
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err, err[-3000:]
    what = (r"loader worker \(pid \d+\) was killed by signal Killed" if kill.startswith("worker") else
            r"a loader worker ended while it handed a batch over \(ConnectionResetError: \[Errno 104\] Connection reset by peer\)")
    assert re.fullmatch(rf"error: (rank \d: )?{what}; "
                        r"if the system ran out of memory, lower config\.DATA\.NUM_DATALOADER_WORKERS or the batch size; "
                        r"rerun the same command to resume", err.splitlines()[-1]), err[-3000:]
    r = run(cfg, folder, *args)
    assert r.returncode == 0 and "resumed from" in r.stdout + r.stderr, r.stderr[-3000:]


def test_resume_does_not_replay_data(setup, tmp_path):
    root, cfg = setup
    folder, reads = tmp_path / "run", tmp_path / "reads.txt"
    # the iteration-4 checkpoint must be on disk at the kill: written synchronously (a background
    # write still in flight at a SIGKILL is lost, and the run resumes from the one before)
    r = run(cfg, folder, "config.TEST_MODEL=false", "config.CHECKPOINT.ASYNC_WRITE=false", kill="step:4")
    assert r.returncode == -signal.SIGKILL
    reads.write_text("")
    r = run(cfg, folder, "config.TEST_MODEL=false", reads=reads)
    assert r.returncode == 0, r.stderr[-2000:]
    batch = 8
    # the resumed run reads the 2 remaining batches of phase 0, then 2 whole phases
    assert len(train_reads(reads)) == (ITERS_PER_EPOCH - 4) * batch + (EPOCHS - 1) * ITERS_PER_EPOCH * batch


def test_a_resumed_run_logs_each_iteration_once(setup, tmp_path):
    """Iterations run after the last checkpoint are run again after a crash: stdout.json and
    metrics.json still hold one line per iteration and per phase."""
    root, cfg = setup
    folder = tmp_path / "run"
    # iteration 8's checkpoint is on disk (written synchronously) when the run dies after logging 9
    r = run(cfg, folder, "config.CHECKPOINT.ASYNC_WRITE=false", kill="step:9")
    assert r.returncode == -signal.SIGKILL
    assert max(losses(folder)) == 9
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(x) for x in (folder / "stdout.json").read_text().splitlines()]
    assert [s["iteration"] for s in steps] == list(range(1, ITERS_PER_EPOCH * EPOCHS + 1))
    assert len({(s["phase_idx"], s["local_iteration"]) for s in steps}) == len(steps)
    phases = [json.loads(x)["phase_idx"] for x in (folder / "metrics.json").read_text().splitlines()]
    assert phases == list(range(2 * EPOCHS))  # a train and a test phase per epoch


def test_precise_bn_after_a_resume_inside_the_phase_uses_the_whole_epoch(setup, tmp_path):
    """HOOKS.PRECISE_BN counted the batches it may use on the train loader as the resume left
    it, started at the checkpoint's batch: after a kill that followed an iteration checkpoint at
    a train phase's last step, it recomputed the statistics over 0 batches (every BatchNorm got
    zero mean and variance, the next test loss was in the hundreds), and near a phase's end over
    fewer batches than the uninterrupted run."""
    root, cfg = setup
    extra = ["config.HOOKS.PRECISE_BN.USE_PRECISE_BN=true", "config.HOOKS.PRECISE_BN.NUM_ITERATIONS=4",
             "config.CHECKPOINT.ASYNC_WRITE=false"]
    ref = tmp_path / "ref"
    r = run(cfg, ref, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    folder = tmp_path / "killed"
    # iteration 12's checkpoint (the last step of train phase 1) is on disk when the run dies
    r = run(cfg, folder, *extra, kill=f"step:{2 * ITERS_PER_EPOCH}")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    r = run(cfg, folder, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "over 0 batches" not in r.stdout
    assert (folder / "metrics.json").read_text() == (ref / "metrics.json").read_text()
    assert_bitwise_equal(tensors_of(ref / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


def test_an_ema_with_precise_bn_resumes_to_the_same_average(setup, tmp_path):
    """fvcore's update_bn_stats puts new tensors in place of the BatchNorm buffers; the EMA kept
    averaging the old ones, which the model no longer used, from the first precise BN on. A
    resumed run took the model's buffers of the time, so its EMA (and its test_ema_ meters)
    differed from the uninterrupted run's. The statistics now go into the model's own buffers."""
    root, cfg = setup
    extra = ["config.HOOKS.PRECISE_BN.USE_PRECISE_BN=true", "config.HOOKS.PRECISE_BN.NUM_ITERATIONS=2",
             "config.HOOKS.EMA_MODEL.ENABLE_EMA_METERS=true", "config.HOOKS.EMA_MODEL.DECAY=0.9",
             "config.CHECKPOINT.ASYNC_WRITE=false"]
    ref = tmp_path / "ref"
    r = run(cfg, ref, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    folder = tmp_path / "killed"
    r = run(cfg, folder, *extra, kill=f"step:{ITERS_PER_EPOCH + 4}")  # after iteration 10's checkpoint
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    r = run(cfg, folder, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (folder / "metrics.json").read_text() == (ref / "metrics.json").read_text()
    ema = lambda path: classy_state(path)["hooks"]["EMAModelHook"]["ema_model"]  # noqa: E731
    assert_bitwise_equal(ema(ref / "checkpoint.torch"), ema(folder / "checkpoint.torch"))
    assert_bitwise_equal(tensors_of(ref / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


def test_truncated_newest_checkpoint_is_skipped(setup, reference):
    root, cfg = setup
    folder = root / "truncated"
    r = run(cfg, folder, "config.CHECKPOINT.ASYNC_WRITE=false", kill="step:9")  # step 8's file on disk
    assert r.returncode == -signal.SIGKILL
    newest = (folder / "checkpoint.torch").resolve()
    assert newest.name == "model_iteration8.torch"
    newest.write_bytes(newest.read_bytes()[:1000])
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "skipping checkpoint model_iteration8.torch" in out
    assert "resumed from" in out
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


def test_finished_run_is_not_retrained(setup, reference, tmp_path):
    root, cfg = setup
    before = {p.name: p.stat().st_mtime_ns for p in reference[0].iterdir()}
    r = run(cfg, reference[0], "config.DATA.NUM_DATALOADER_WORKERS=0")
    assert r.returncode == 0
    assert "has finished" in r.stdout + r.stderr
    after = {p.name: p.stat().st_mtime_ns for p in reference[0].iterdir() if p.name in before}
    changed = [n for n in before if n not in ("log.txt",) and before[n] != after.get(n)]
    assert not changed, changed


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_finished_runs_damaged_final_checkpoint_is_written_again(setup, reference, tmp_path, damage):
    """A final checkpoint damaged after the run (a half copy, a disk) does not make the folder a
    finished run: the rerun says so, goes on from the newest good checkpoint and writes the final
    checkpoint again, equal to the uninterrupted run's (was: "has finished", exit 0, and the
    pointer left on the broken file that PARAMS_FILE=<folder>/checkpoint.torch then refuses)."""
    root, cfg = setup
    folder = tmp_path / "finished"
    shutil.copytree(reference[0], folder, symlinks=True)
    final = folder / f"model_final_checkpoint_phase{EPOCHS - 1}.torch"
    final.write_bytes(final.read_bytes()[:1000] if damage == "truncated" else b"")
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert f"{final.name} cannot be used" in out and "the run is not finished after all" in out, out[-3000:]
    assert "has finished" not in out
    assert os.readlink(folder / "checkpoint.torch") == final.name
    assert_bitwise_equal(tensors_of(reference[0] / final.name), tensors_of(final))
    r = run(cfg, folder)  # now it is finished
    assert r.returncode == 0 and "has finished" in r.stdout + r.stderr
    if damage == "truncated":  # without auto-resume the warning says what happens: a new run from scratch
        final.write_bytes(final.read_bytes()[:1000])
        r = run(cfg, folder, "config.CHECKPOINT.AUTO_RESUME=false")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-3000:]
        assert "with config.CHECKPOINT.AUTO_RESUME=false it trains again from scratch" in out, out[-3000:]
        assert "goes on from its newest good checkpoint" not in out and (folder / "previous_run.1").is_dir()


@pytest.mark.parametrize("pointer", ["earlier", "last_iteration", "missing"])
def test_a_finished_run_killed_before_its_pointer_swap_gets_its_pointer_back(setup, reference, tmp_path, pointer):
    """A kill between the final checkpoint's rename and the pointer swap left checkpoint.torch on
    an earlier file (or none) for good: the rerun, which finds the run finished, points it at
    the final checkpoint (what PARAMS_FILE=<folder>/checkpoint.torch is meant to load). The
    iteration checkpoint of the run's last step has the final one's counters: the phase's end
    is still the further (was: the pointer stayed on the iteration checkpoint)."""
    root, cfg = setup
    folder = tmp_path / "finished"
    extra = []
    if pointer == "last_iteration":  # no test phase after the last train phase: the two share their counters
        extra = ["config.TEST_MODEL=false"]
        assert run(cfg, folder, *extra).returncode == 0
    else:
        shutil.copytree(reference[0], folder, symlinks=True)
    final = f"model_final_checkpoint_phase{EPOCHS - 1}.torch"
    assert os.readlink(folder / "checkpoint.torch") == final
    (folder / "checkpoint.torch").unlink()
    if pointer == "earlier":
        earlier = sorted(p.name for p in folder.glob("model_iteration*.torch"))[-1]
        (folder / "checkpoint.torch").symlink_to(earlier)
    elif pointer == "last_iteration":
        last = f"model_iteration{ITERS_PER_EPOCH * EPOCHS}.torch"
        assert (folder / last).is_file()
        (folder / "checkpoint.torch").symlink_to(last)
    r = run(cfg, folder, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "has finished" in out and f"but the run's final checkpoint {final} was written after it" in out, out[-2000:]
    assert os.readlink(folder / "checkpoint.torch") == final
    r = run(cfg, folder, *extra)  # and it stays as it is
    assert r.returncode == 0 and "was written after it" not in r.stdout + r.stderr


def test_test_only_refuses_to_continue_a_training_folder(setup, reference, tmp_path):
    """TEST_ONLY builds one test phase: resuming a training's mid-phase checkpoint into it failed
    with a KeyError traceback, a phase-end one ran nothing, a finished one said "finished"."""
    root, cfg = setup
    src = reference[0]
    mid = tmp_path / "mid"
    mid.mkdir()
    shutil.copy(src / "model_iteration8.torch", mid)
    for folder, newest in ((mid, "model_iteration8.torch"), (src, "model_final_checkpoint_phase2.torch")):
        before = sorted(p.name for p in folder.iterdir())
        r = run(cfg, folder, "config.TEST_ONLY=true", "config.DATA.NUM_DATALOADER_WORKERS=0")
        assert r.returncode == 2, r.stderr[-3000:]
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("error: config.TEST_ONLY=true cannot continue a training run") and newest in line
        assert f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={folder / newest}" in line and "Traceback" not in r.stderr
        assert sorted(p.name for p in folder.iterdir() if p.name != "log.txt") == [n for n in before if n != "log.txt"]


def test_resuming_from_a_finished_checkpoint_says_nothing_is_left(setup, reference, tmp_path):
    """RESUME_FROM the final checkpoint of another folder ran no phase and exited 0, writing nothing."""
    root, cfg = setup
    final = reference[0] / "model_final_checkpoint_phase2.torch"
    r = run(cfg, tmp_path / "new", f"config.CHECKPOINT.RESUME_FROM={final}", "config.DATA.NUM_DATALOADER_WORKERS=0")
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line == (f"error: {final} was written after 3 training epochs of its run, and this config trains "
                    f"config.OPTIMIZER.num_epochs=3: nothing is left to run; raise config.OPTIMIZER.num_epochs above 3 "
                    f"to train on from it, or start a new run from its weights with "
                    f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE"), line
    # fewer epochs than the checkpoint's run: the counts are the checkpoint's and the config's (was "after phase 2
    # of its run and this config has 2 phases")
    r = run(cfg, tmp_path / "fewer", f"config.CHECKPOINT.RESUME_FROM={final}", "config.OPTIMIZER.num_epochs=1")
    assert r.returncode == 2 and "after 3 training epochs of its run, and this config trains " \
        "config.OPTIMIZER.num_epochs=1" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    # a checkpoint written inside epoch 2 (iteration 8 of 6 per epoch) goes on under num_epochs=2: the
    # line says so (it said "after 2 training epochs ... above 2")
    inside = reference[0] / "model_iteration8.torch"
    r = run(cfg, tmp_path / "inside", f"config.CHECKPOINT.RESUME_FROM={inside}", "config.OPTIMIZER.num_epochs=1")
    assert r.returncode == 2 and (f"error: {inside} was written during training epoch 2 of its run, and this config "
                                  "trains config.OPTIMIZER.num_epochs=1: nothing is left to run; raise "
                                  "config.OPTIMIZER.num_epochs to 2 or more") in r.stderr, r.stderr[-2000:]
    assert "going on from the next phase" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]  # there is none
    # with more epochs it trains on from there
    r = run(cfg, tmp_path / "more", f"config.CHECKPOINT.RESUME_FROM={final}", "config.DATA.NUM_DATALOADER_WORKERS=0",
            "config.OPTIMIZER.num_epochs=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "more" / "model_final_checkpoint_phase3.torch").is_file()


def test_keep_last_and_overwrite_existing(setup, tmp_path):
    root, cfg = setup
    folder = tmp_path / "keep"
    r = run(cfg, folder, "config.CHECKPOINT.KEEP_LAST=2", "config.TEST_MODEL=false")
    assert r.returncode == 0, r.stderr[-2000:]
    names = sorted(p.name for p in folder.glob("model_*.torch"))
    assert f"model_final_checkpoint_phase{EPOCHS - 1}.torch" in names
    assert len([n for n in names if "final" not in n]) == 2, names
    # started over: the finished run's files are moved aside, never deleted, never pruned by the new run
    kept = sorted(p.name for p in folder.glob("model_*.torch"))
    r = run(cfg, folder, "config.CHECKPOINT.OVERWRITE_EXISTING=true", "config.CHECKPOINT.AUTO_RESUME=false",
            "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false", "config.CHECKPOINT.KEEP_LAST=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (folder / "model_final_checkpoint_phase0.torch").exists()
    assert not (folder / f"model_final_checkpoint_phase{EPOCHS - 1}.torch").exists()
    assert sorted(p.name for p in (folder / "previous_run.1").glob("model_*.torch")) == kept


def file_states(folder):
    """name -> (bytes, mtime) of every file and link under ``folder`` but log.txt (a rerun appends to it)."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = str(p.relative_to(folder))
        if p.name == "log.txt" or (p.is_dir() and not p.is_symlink()):
            continue
        content = "-> " + os.readlink(p) if p.is_symlink() else p.read_bytes()
        out[rel] = (content, p.lstat().st_mtime_ns)
    return out


def test_overwrite_existing_resumes_a_finished_run_as_vissl_and_deletes_nothing(setup, reference, tmp_path):
    """VISSL's CHECKPOINT.OVERWRITE_EXISTING only lifts the "training finished" check: with
    AUTO_RESUME the run resumes from the folder's newest checkpoint, the final one, so nothing is
    left to run (the finished message, exit 0, every file as it was); with more epochs it trains on."""
    root, cfg = setup
    folder = tmp_path / "finished"
    shutil.copytree(reference[0], folder, symlinks=True)
    before = file_states(folder)
    r = run(cfg, folder, "config.CHECKPOINT.OVERWRITE_EXISTING=true")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert f"the run in {folder} has finished (model_final_checkpoint_phase{EPOCHS - 1}.torch exists); nothing to do" in out
    assert "AUTO_RESUME=false to train again from scratch" in out
    assert file_states(folder) == before
    r = run(cfg, folder, "config.CHECKPOINT.OVERWRITE_EXISTING=true", f"config.OPTIMIZER.num_epochs={EPOCHS + 1}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {folder / f'model_final_checkpoint_phase{EPOCHS - 1}.torch'}" in r.stdout
    assert (folder / f"model_final_checkpoint_phase{EPOCHS}.torch").is_file()
    after = file_states(folder)
    assert all(after[name] == state for name, state in before.items() if name.startswith("model_")), "a file changed"


def _positions(folder, name):
    """(train_phase_idx, phase type) of each line of a metrics.json / stdout.json, and the global
    iterations of the stdout.json lines."""
    lines = [json.loads(line) for line in (folder / name).read_text().splitlines()]
    if name == "stdout.json":
        return [line["iteration"] for line in lines]
    return [(r["train_phase_idx"], "train" if "train_loss" in r else "test") for r in lines]


def test_training_on_with_other_test_phases_keeps_every_line_of_the_earlier_phases(setup, tmp_path):
    """A finished 2-epoch run tested after epochs 0 and 1 (TEST_EVERY_NUM_EPOCH=2): trained on to
    4 epochs, its phase indices name other phases (the test after epoch 1 is phase 3 there, train
    epoch 2 here). Its lines stay, each once, whatever this run calls their phase: metrics.json
    lost the test line after epoch 1, and with TEST_MODEL switched off stdout.json lost epoch 1."""
    root, cfg = setup
    first = tmp_path / "first"
    r = run(cfg, first, "config.OPTIMIZER.num_epochs=2", "config.TEST_EVERY_NUM_EPOCH=2")
    assert r.returncode == 0, r.stderr[-3000:]
    old = [(0, "train"), (0, "test"), (1, "train"), (1, "test")]
    assert _positions(first, "metrics.json") == old
    assert _positions(first, "stdout.json") == list(range(1, 2 * ITERS_PER_EPOCH + 1))

    def train_on(name, epochs, *extra):
        folder = tmp_path / name
        shutil.copytree(first, folder, symlinks=True)
        r = run(cfg, folder, "config.CHECKPOINT.OVERWRITE_EXISTING=true", f"config.OPTIMIZER.num_epochs={epochs}", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _positions(folder, "stdout.json") == list(range(1, epochs * ITERS_PER_EPOCH + 1))
        return _positions(folder, "metrics.json")

    assert train_on("on", 4, "config.TEST_EVERY_NUM_EPOCH=2") == old + [(2, "train"), (2, "test"), (3, "train"),
                                                                      (3, "test")]
    assert train_on("untested", 3, "config.TEST_MODEL=false") == old + [(2, "train")]


def test_a_new_run_from_scratch_never_resumes_the_earlier_runs_files(setup, reference, tmp_path):
    """OVERWRITE_EXISTING with AUTO_RESUME=false trains a finished folder again from scratch (VISSL).
    The earlier run's files are moved into previous_run.1 first (same bytes and times), so when the
    new run is killed, before or after its first checkpoint, the next run resumes from the new run's
    own newest checkpoint or starts afresh, never from the earlier run's; and it ends bit for bit
    where an uninterrupted run does."""
    root, cfg = setup
    folder = tmp_path / "again"
    shutil.copytree(reference[0], folder, symlinks=True)
    earlier = file_states(folder)
    sync = "config.CHECKPOINT.ASYNC_WRITE=false"  # the iteration-4 file is on disk at the kill
    # killed at step 1, before its first checkpoint (every 2 iterations)
    r = run(cfg, folder, "config.CHECKPOINT.OVERWRITE_EXISTING=true", "config.CHECKPOINT.AUTO_RESUME=false", sync,
            kill="step:1")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert "moved" in r.stdout and str(folder / "previous_run.1") in r.stdout
    assert file_states(folder / "previous_run.1") == {n: s for n, s in earlier.items()}
    assert not list(folder.glob("model_*.torch")) and not os.path.lexists(folder / "checkpoint.torch")
    # the next run (AUTO_RESUME on) finds no checkpoint of its own: it starts afresh; killed at step 4
    r = run(cfg, folder, sync, kill="step:4")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert "resumed from" not in r.stdout + r.stderr
    # and the next one resumes from that run's own newest checkpoint
    r = run(cfg, folder, sync)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {folder / 'model_iteration4.torch'} " in r.stdout
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))
    assert file_states(folder / "previous_run.1") == earlier
    assert not (folder / "previous_run.2").exists()


def train_reads(path):
    """Indices of the TRAIN samples training read, in the order read, from a $SSL_TEST_READS file
    of one run. Its first read is the pre-launch check's (sample 0 through the transforms and the
    collator, in the tool's process before any rank starts): left out."""
    reads = [int(ln.split()[1]) for ln in Path(path).read_text().splitlines() if ln.startswith("TRAIN ")]
    assert reads[:1] == [0], reads[:3]
    return reads[1:]


NEW_GLOBAL_BATCH = {  # a change between a run and its resume -> (overrides, this run's global batch)
    "batch_doubled": (["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16"], 16),
    "batch_tripled": (["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=24"], 24),  # 32 samples done: not a multiple of 24
    "two_ranks": (["config.DISTRIBUTED.NUM_PROC_PER_NODE=2"], 16),
}


@pytest.mark.parametrize("change", list(NEW_GLOBAL_BATCH))
def test_resume_with_another_global_batch_trains_on_the_rest_of_the_phase(setup, tmp_path, change):
    """The checkpoint's position (batches of 8) is converted by samples into this run's batches:
    the resumed phase reads the samples its first part had not, and a warning says so once."""
    root, cfg = setup
    folder, before, after = tmp_path / "run", tmp_path / "before.txt", tmp_path / "after.txt"
    n, done = 48, 4 * 8  # iteration 10's checkpoint: 4 batches of 8 into train phase 1 (of 6)
    r = run(cfg, folder, "config.TEST_MODEL=false", "config.CHECKPOINT.ASYNC_WRITE=false", kill="step:10", reads=before)
    assert r.returncode == -signal.SIGKILL
    overrides, batch = NEW_GLOBAL_BATCH[change]
    r = run(cfg, folder, "config.TEST_MODEL=false", *overrides, reads=after)
    assert r.returncode == 0, r.stderr[-3000:]
    start, phase_len = done // batch, -(-n // batch)
    # iterations of phase 1 after the resume: this run's batches start..phase_len (its own phase length)
    steps = [json.loads(x) for x in (folder / "stdout.json").read_text().splitlines()]
    assert [s["local_iteration"] for s in steps if s["phase_idx"] == 1 and s["phase_iterations"] == 6] == [1, 2, 3, 4]
    resumed = [s for s in steps if s["phase_idx"] == 1 and s["phase_iterations"] == phase_len]
    assert [s["local_iteration"] for s in resumed] == list(range(start + 1, phase_len + 1)), steps
    assert [s["iteration"] for s in resumed] == list(range(11, 11 + phase_len - start))
    # every sample of epoch 1 is trained on: 32 before the kill, the rest (and the partial batch again) after
    first, rest = train_reads(before)[n:], Counter(train_reads(after)) - Counter(range(n))  # after: epoch 2 once
    assert len(first) == done and sum(rest.values()) == n - start * batch
    assert set(first) | set(rest) == set(range(n))
    assert len(set(first) & set(rest)) == done - start * batch  # seen twice: 0, or 8 with batches of 24
    assert (folder / "model_final_checkpoint_phase2.torch").exists()
    # the lr schedule keeps its place by epochs: a step's lr is the cosine at (epochs done + part
    # of this epoch) / EPOCHS in the batches of the run that took it, before and after the resume
    for s in (s for s in steps if s["phase_type"] == "train"):
        where = (s["train_phase_idx"] * s["phase_iterations"] + s["local_iteration"] - 1) / (s["phase_iterations"] * EPOCHS)
        assert s["lr"] == pytest.approx(0.001 + 0.5 * (0.1 - 0.001) * (1 + math.cos(math.pi * where)), rel=1e-9), s
    out = r.stdout + r.stderr
    line = (f"the checkpoint stopped 4 batches of 8 (32 samples) into train phase 1; this run's global batch is "
            f"{batch}{' (2 ranks x 8)' if change == 'two_ranks' else ''}: it goes on from batch {start} of {phase_len}")
    assert out.count(line) == 1, out[-3000:]
    if done % batch:
        assert f"{line} (at sample {start * batch}), so {done - start * batch} samples of the phase are seen twice" in out
    if change == "two_ranks":
        assert out.count("the checkpoint was written by 1 rank, this run has 2: RNG states are not restored exactly") == 1
    else:
        assert "RNG states" not in out


def test_resume_after_the_data_changed_size_says_so(setup, tmp_path):
    root, cfg = setup
    folder = tmp_path / "run"
    r = run(cfg, folder, "config.TEST_MODEL=false", "config.CHECKPOINT.ASYNC_WRITE=false", kill="step:10")
    assert r.returncode == -signal.SIGKILL
    r = run(cfg, folder, "config.TEST_MODEL=false", "config.DATA.TRAIN.DATA_LIMIT=40")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert ("the checkpoint stopped 4 batches of 8 (32 samples) into train phase 1 (48 samples); this run's train "
            "data has 40 samples: it goes on from batch 4 of 5, in the new data's order") in out, out[-3000:]
    steps = [json.loads(x) for x in (folder / "stdout.json").read_text().splitlines()]
    assert [s["local_iteration"] for s in steps if s["phase_idx"] == 1] == [1, 2, 3, 4, 5]
    assert (folder / "model_final_checkpoint_phase2.torch").exists()


def test_a_checkpoint_without_phase_data_resumes_as_before(setup, reference, tmp_path):
    """Checkpoints written before phase_data was stored resume at their batch count, bit for bit."""
    root, cfg = setup
    data = torch.load(str(reference[0] / "model_iteration8.torch"), map_location="cpu", weights_only=True)
    assert data["classy_state_dict"].pop("phase_data") == {"global_batch": 8, "num_samples": 48, "batches": 6}
    assert not data["classy_state_dict"]["phase_complete"]
    folder = tmp_path / "old"
    folder.mkdir()
    torch.save(data, str(folder / "model_iteration8.torch"))
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    # no warning but the one for the metrics lines this bare folder lacks (it holds the checkpoint alone)
    warnings = [w for w in re.findall(r"^(?:\[rank \d+\] )?W \d.*$", out, re.M) if "has no line for " not in w]
    assert "resumed from" in out and not warnings, out[-3000:]
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


def test_training_on_with_another_optimizer_is_one_line_and_changed_values_are_the_configs(tmp_path):
    """A checkpoint's optimizer state fits only its own optimizer (sgd has no Adam moments): another
    OPTIMIZER.name is one line naming the key, exit 2, not a KeyError from torch. Values the
    config changes (momentum, weight_decay) are the config's after the resume, as in VISSL, and
    the log says which changed, so that train_config.yaml tells what ran."""
    import ssl_engine.checkpoint as ck

    base = ["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path}", "config.DATA.TRAIN.DATA_LIMIT=16",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=0",
            "config.OPTIMIZER.name=sgd", "config.OPTIMIZER.momentum=0.9", "config.OPTIMIZER.weight_decay=0.0001"]
    r = run_tool([*base, "config.OPTIMIZER.num_epochs=1"])
    assert r.returncode == 0, r.stderr[-3000:]
    on = [*base, "config.OPTIMIZER.num_epochs=2", "config.CHECKPOINT.OVERWRITE_EXISTING=true"]
    r = run_tool([*on, "config.OPTIMIZER.name=adam"])
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err[-1].startswith("error: ") and "config.OPTIMIZER.name gives Adam but the checkpoint holds SGD's state" in err[-1]
    r = run_tool([*on, "config.OPTIMIZER.momentum=0.5", "config.OPTIMIZER.weight_decay=0.01"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "momentum 0.9 -> 0.5" in r.stdout + r.stderr and "weight_decay 0.0001 -> 0.01" in r.stdout + r.stderr
    groups = ck.load_checkpoint(tmp_path / "model_final_checkpoint_phase1.torch")[
        "classy_state_dict"]["optimizer"]["optimizer"]["param_groups"]
    assert {g["momentum"] for g in groups} == {0.5}
    assert {g["weight_decay"] for g in groups} - {0.0} == {0.01}


def vissl_layout(ours, phase_idx, train_phase_idx):
    """Checkpoint ``ours`` in VISSL 0.1.6's layout: classy_vision's task state (optimizer as
    ``{"optim": ...}``, meters in classy's format, no loop position inside a phase) and VISSL's
    counters at the top level, ``phase_idx`` / ``train_phase_idx`` of the last finished phase."""
    s = ours["classy_state_dict"]
    return {
        "phase_idx": phase_idx, "train_phase_idx": train_phase_idx, "iteration": ours["iteration"],
        "iteration_num": ours["iteration"] + 2 * train_phase_idx + 2, "loss": {},
        "classy_state_dict": {
            "train": True, "phase_idx": phase_idx, "train_phase_idx": train_phase_idx,
            "num_updates": ours["iteration"], "base_model": s["base_model"],
            "meters": [{"name": "accuracy_list_meter", "topk_values": [1, 5]}],
            "optimizer": {"optim": s["optimizer"]["optimizer"]}, "losses": [], "hooks": {"checkpoint_hook": {}},
            "loss": {},
        },
    }


@pytest.mark.parametrize("written", ["phase", "iteration"])
def test_a_folder_vissl_trained_in_goes_on_from_vissls_checkpoint(setup, reference, tmp_path, written):
    """A VISSL user reruns the config in the folder VISSL trained in: the run goes on from VISSL's
    checkpoint by VISSL's rule (an iteration checkpoint's batch is iteration - finished epochs x
    batches per epoch) with its weights and optimizer state, and ends with the uninterrupted
    run's model and optimizer bit for bit."""
    root, cfg = setup
    if written == "phase":  # the end of train phase 0 (phase 0 of VISSL's list)
        ours = torch.load(str(reference[0] / "model_phase0.torch"), map_location="cpu", weights_only=True)
        data, name = vissl_layout(ours, phase_idx=0, train_phase_idx=0), "model_phase0.torch"
    else:  # 2 batches into train phase 1 (phase 2): VISSL stores phase 1 / train phase 0
        ours = torch.load(str(reference[0] / "model_iteration8.torch"), map_location="cpu", weights_only=True)
        data, name = vissl_layout(ours, phase_idx=1, train_phase_idx=0), "model_iteration8.torch"
    folder = tmp_path / "vissl_folder"
    folder.mkdir()
    torch.save(data, str(folder / name))
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Traceback" not in out and f"resumed from {folder / name}" in out, out[-3000:]
    assert "does not fit this run" not in out, out[-3000:]
    if written == "iteration":
        assert "the run goes on in train phase 1 at batch 2 of 6" in out, out[-3000:]
        steps = [json.loads(x) for x in (folder / "stdout.json").read_text().splitlines()]
        assert [s["iteration"] for s in steps if s["phase_type"] == "train"][:1] == [9]
    ref = tensors_of(reference[0] / "checkpoint.torch")
    got = tensors_of(folder / "checkpoint.torch")
    assert_bitwise_equal({k: ref[k] for k in ("model", "optimizer")}, {k: got[k] for k in ("model", "optimizer")})


def test_a_vissl_linear_evaluation_folder_resumes_and_extracts(tmp_path):
    """VISSL wraps the frozen trunk of a linear evaluation in a feature extractor, so its
    checkpoints name the trunk's weights base_model._feature_blocks.*: resuming that folder, and
    extracting features from it, load them under the trunk's own names (was: exit 2, "its weights
    do not fit this model ... 'trunk.base_model._feature_blocks.conv1.weight'")."""
    import ssl_engine.checkpoint as ck
    from ssl_engine.config import compose
    from ssl_engine.models.model import build_model

    torch.manual_seed(3)
    model = build_model(compose(["config=quick/linear_eval_digits"], warn_unused=False).MODEL)
    trunk = {"base_model." + k: v for k, v in model.trunk.state_dict().items()}
    task_state = {"train": True, "phase_idx": 0, "train_phase_idx": 0, "num_updates": 1, "losses": [], "hooks": {},
                  "base_model": {"model": {"trunk": trunk, "heads": model.heads.state_dict()}, "meta": {}},
                  "meters": [], "optimizer": {}, "loss": {}}
    vissl = {"phase_idx": 0, "train_phase_idx": 0, "iteration": 1, "iteration_num": 1, "loss": {},
             "type": "consolidated", "classy_state_dict": task_state}
    small = ["config=quick/linear_eval_digits", "config.DATA.TRAIN.DATA_LIMIT=32", "config.DATA.TEST.DATA_LIMIT=32",
             "config.OPTIMIZER.num_epochs=2", "config.OPTIMIZER.param_schedulers.lr.milestones=[1]"]
    for name in ("resume", "extract"):
        (tmp_path / name).mkdir()
        torch.save(vissl, str(tmp_path / name / "model_phase0.torch"))
    r = run_tool([*small, f"config.CHECKPOINT.DIR={tmp_path / 'resume'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {tmp_path / 'resume' / 'model_phase0.torch'}" in r.stdout + r.stderr
    final = ck.load_checkpoint(tmp_path / "resume" / "model_final_checkpoint_phase1.torch")
    got = final["classy_state_dict"]["base_model"]["model"]["trunk"]
    for k, v in model.trunk.state_dict().items():  # the frozen trunk is VISSL's, untouched
        assert torch.equal(got[k], v), k
    r = run_tool(["config=extract/simclr_digits_trunk", "config.DATA.TRAIN.DATA_LIMIT=32", "config.DATA.TEST.DATA_LIMIT=32",
                  f"config.CHECKPOINT.DIR={tmp_path / 'extract'}", f"config.EXTRACT_FEATURES.OUTPUT_DIR={tmp_path / 'feats'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    status = json.loads((tmp_path / "feats" / "extraction_train.json").read_text())
    assert status["status"] == "complete" and str(tmp_path / "extract" / "model_phase0.torch") in status["weights"]


def test_vissl_optimizer_state_that_does_not_fit_starts_fresh_with_a_warning(setup, reference, tmp_path):
    root, cfg = setup
    ours = torch.load(str(reference[0] / "model_phase0.torch"), map_location="cpu", weights_only=True)

    def resume_from_edited(name, edit):
        """The run's output going on from VISSL's layout of phase 0, its optimizer state edited."""
        data = vissl_layout(ours, phase_idx=0, train_phase_idx=0)
        edit(data["classy_state_dict"]["optimizer"]["optim"])
        folder = tmp_path / name
        folder.mkdir()
        torch.save(data, str(folder / "model_phase0.torch"))
        r = run(cfg, folder, "config.OPTIMIZER.num_epochs=2")
        assert r.returncode == 0, r.stderr[-3000:]
        assert (folder / "model_final_checkpoint_phase1.torch").exists()
        return r.stdout + r.stderr

    def other_models_tensor(optim):
        optim["state"][min(optim["state"])] = {"momentum_buffer": torch.zeros(3, 3)}

    out = resume_from_edited("vissl_other", other_models_tensor)
    assert ("VISSL's checkpoint: the state of the optimizer (the checkpoint's optimizer state does not fit this "
            "model: its momentum_buffer of parameter 0 has shape [3, 3], the parameter [32, 192]) does not fit this "
            "run and starts fresh") in out, out[-3000:]

    # VISSL's head_optimizer_params layout: 4 groups (trunk and heads, each regularized and not) even
    # when empty; was: advice to resume with head_optimizer_params, which can never give 4 groups
    def four_groups(optim):
        optim["param_groups"] = optim["param_groups"] + [dict(g, params=[]) for g in optim["param_groups"]]

    out = resume_from_edited("vissl_four_groups", four_groups)
    assert ("VISSL's checkpoint: the state of the optimizer (VISSL's 4 param groups, trunk and heads each regularized "
            "and not, are not mapped onto this run's; its momentum builds up again from zero) does not fit this run "
            "and starts fresh") in out, out[-3000:]
    assert "head_optimizer_params" not in out


def test_a_checkpoint_with_impossible_counters_is_skipped_or_refused(setup, reference, tmp_path):
    """A checkpoint whose loop counters are missing or out of range (a hand-edited or foreign
    file) is skipped by auto-resume for the older one, and refused by name under RESUME_FROM
    (exit 2, one line): never a KeyError, never a run counting from iteration -5."""
    root, cfg = setup
    folder = tmp_path / "edited"
    folder.mkdir()
    for name in ("model_phase0.torch", "model_iteration8.torch"):
        shutil.copy(reference[0] / name, folder / name)
    bad = torch.load(str(folder / "model_iteration8.torch"), map_location="cpu", weights_only=True)
    bad["classy_state_dict"]["iteration"] = -5
    torch.save(bad, str(folder / "model_iteration8.torch"))
    r = run(cfg, tmp_path / "explicit", f"config.CHECKPOINT.RESUME_FROM={folder / 'model_iteration8.torch'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: config.CHECKPOINT.RESUME_FROM: {folder / 'model_iteration8.torch'}: its classy_state_dict.iteration "
        f"is -5, where a training checkpoint has an integer >= 0: it was not written by a training run, or was "
        f"changed since; to start a new run from its weights use config.MODEL.WEIGHTS_INIT.PARAMS_FILE")
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "skipping checkpoint model_iteration8.torch: its classy_state_dict.iteration is -5" in out, out[-3000:]
    assert f"resumed from {folder / 'model_phase0.torch'}" in out
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))


def test_a_position_beyond_the_phase_it_stopped_in_is_an_impossible_counter():
    """A phase stopped part-way is at most as far into its data as the phase is long (the
    checkpoint's own phase_data.batches); further is a changed file, which auto-resume skips and
    RESUME_FROM refuses (it would have ended the phase at once, with no word)."""
    from ssl_engine.resume_state import state_problem

    def checkpoint(local, complete=False):
        return {"classy_state_dict": {"base_model": {"model": {}}, "phase_idx": 0, "train_phase_idx": 0,
                                      "iteration": 3, "local_iteration_num": local, "train": True,
                                      "phase_complete": complete,
                                      "phase_data": {"global_batch": 4, "num_samples": 12, "batches": 3}}}

    assert state_problem(checkpoint(2)) is None and state_problem(checkpoint(3)) is None
    assert state_problem(checkpoint(4)) == (
        "its classy_state_dict.local_iteration_num is 4, beyond the 3 batches of the phase it stopped in "
        "(classy_state_dict.phase_data.batches): it was changed since it was written")
    assert state_problem(checkpoint(10**6, complete=True)) is None  # a finished phase's count is not a position


def test_a_checkpoint_with_nan_weights_is_a_changed_file():
    """A run stops on a non-finite loss before it checkpoints, so NaN / inf weights in a training
    checkpoint come from a changed or foreign file: auto-resume skips it, RESUME_FROM refuses it
    (as PARAMS_FILE refuses such weights), instead of a NaN loss at the first step. A file read
    without its data (meta tensors, the check before launch) is not judged by values."""
    from ssl_engine.resume_state import state_problem

    weights = {"trunk": {"w": torch.ones(3), "n": torch.tensor([1, 2])}, "heads": {"b": torch.zeros(2)}}
    data = {"classy_state_dict": {"base_model": {"model": weights}, "phase_idx": 0, "train_phase_idx": 0,
                                  "iteration": 3, "local_iteration_num": 3, "train": True, "phase_complete": True}}
    assert state_problem(data) is None
    weights["heads"]["b"][1] = float("inf")
    assert state_problem(data) == ("its model weights hold NaN or infinite values ('model.heads.b'): the run that "
                                   "wrote it had diverged (with HOOKS.CHECK_NAN off), or the file was changed since")
    weights["heads"]["b"] = torch.empty(2, device="meta")
    assert state_problem(data) is None


def test_a_checkpoint_without_optimizer_state_says_the_optimizer_starts_fresh(setup, reference, tmp_path):
    root, cfg = setup
    data = torch.load(str(reference[0] / "model_phase0.torch"), map_location="cpu", weights_only=True)
    data["classy_state_dict"]["optimizer"] = {}
    folder = tmp_path / "no_optimizer"
    folder.mkdir()
    torch.save(data, str(folder / "model_phase0.torch"))
    r = run(cfg, folder, "config.OPTIMIZER.num_epochs=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("the checkpoint holds no optimizer state: the optimizer goes on from a fresh state (momentum and moment "
            "estimates start at zero)") in r.stdout + r.stderr


def test_a_run_resumed_inside_a_logging_window_logs_the_same_avg_loss(setup, tmp_path):
    """avg_loss in stdout.json averages the losses since the previous line: a run killed between two
    lines (at iteration 10, after its line; last checkpoint at 9, lines at 8 and 10) goes on with the
    checkpoint's window, and logs every line as the uninterrupted run does, avg_loss included."""
    root, cfg = setup
    extra = ["config.LOG_FREQUENCY=4", "config.OPTIMIZER.num_epochs=2", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=3",
             "config.CHECKPOINT.ASYNC_WRITE=false"]  # iteration 9's file is on disk when step 10 is killed
    ref = tmp_path / "ref"
    assert run(cfg, ref, *extra).returncode == 0
    folder = tmp_path / "killed"
    assert run(cfg, folder, *extra, kill="step:10").returncode == -signal.SIGKILL
    assert (folder / "checkpoint.torch").resolve().name == "model_iteration9.torch"
    r = run(cfg, folder, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(losses(ref)) == [1, 4, 5, 8, 10, 12]
    assert losses(folder) == losses(ref)


def test_a_pointer_left_behind_by_a_kill_is_passed_over_for_the_later_checkpoint(setup, reference, tmp_path):
    """A kill between the rename of a checkpoint and the swap of checkpoint.torch leaves the pointer
    on the one before: the later file is resumed from (with a warning), not the pointer's, so no
    stretch is trained twice. A folder copied without its times (files newer than the pointer's,
    but earlier in the run) keeps the pointer."""
    root, cfg = setup
    folder = tmp_path / "stale"
    folder.mkdir()
    for name in ("model_phase0.torch", "model_iteration8.torch"):
        shutil.copy(reference[0] / name, folder / name)
    os.utime(folder / "model_phase0.torch", ns=(1_000_000_000, 1_000_000_000))
    (folder / "checkpoint.torch").symlink_to("model_phase0.torch")
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert ("checkpoint.torch points to model_phase0.torch, but model_iteration8.torch was written later in the run: "
            "resuming from the later one") in out, out[-3000:]
    assert f"resumed from {folder / 'model_iteration8.torch'}" in out
    assert_bitwise_equal(tensors_of(reference[0] / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))

    copied = tmp_path / "copied"
    copied.mkdir()
    for name in ("model_iteration8.torch", "model_phase0.torch"):  # the older one copied last: newer on disk
        shutil.copy(reference[0] / name, copied / name)
        time.sleep(0.01)
    (copied / "checkpoint.torch").symlink_to("model_iteration8.torch")
    r = run(cfg, copied)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "written later in the run" not in out and f"resumed from {copied / 'model_iteration8.torch'}" in out


@pytest.mark.parametrize("async_write", ["true", "false"])
def test_a_run_folder_deleted_under_the_run_stops_it_with_one_line(setup, tmp_path, async_write):
    """The run made its folder: one deleted under it is not made again (a quiet exit 0 with its
    config, log and lock gone), nor reported as 'the previous files there are intact'; the run
    stops at the next file it writes there, naming the folder, exit 2."""
    root, cfg = setup
    folder = tmp_path / "run"
    r = run(cfg, folder, f"config.CHECKPOINT.ASYNC_WRITE={async_write}", kill="rmtree:3")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert f"its folder {folder} is gone (deleted or moved while the run was using it" in line, line
    assert "intact" not in line and not folder.exists()


def test_a_metrics_file_emptied_before_a_resume_says_which_lines_are_lost(setup, reference, tmp_path):
    """The phases a checkpoint covers are not run again: when metrics.json lost their lines (the
    file emptied or deleted by hand), the resumed run says which, instead of ending with a file
    that silently starts at a later phase."""
    root, cfg = setup
    folder = tmp_path / "emptied"
    folder.mkdir()
    shutil.copy(reference[0] / "model_iteration8.torch", folder / "model_iteration8.torch")
    (folder / "metrics.json").write_text("")
    r = run(cfg, folder)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"{folder / 'metrics.json'} has no line for train phase 0, the test phase after train phase 0, which "
            f"the checkpoint covers (the file was emptied, replaced, cut or deleted since)") in r.stdout + r.stderr
    phases = [json.loads(x)["phase_idx"] for x in (folder / "metrics.json").read_text().splitlines()]
    assert phases == [2, 3, 4, 5]
    # its last line cut (a copy that stopped short, an edit): the test phase that line held is named
    cut = tmp_path / "cut"
    shutil.copytree(reference[0], cut, symlinks=True)
    for p in cut.glob("model_*.torch"):
        if p.name != "model_iteration10.torch":
            p.unlink()
    (cut / "checkpoint.torch").unlink()
    lines = (cut / "metrics.json").read_text().splitlines(keepends=True)[:2]  # phases 0, 1: what iteration 10 covers
    (cut / "metrics.json").write_text("".join(lines)[:-30])
    r = run(cfg, cut)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{cut / 'metrics.json'} has no line for the test phase after train phase 0, which" in r.stdout + r.stderr
    # a resume from a folder with every line: no such warning
    whole = tmp_path / "whole"
    shutil.copytree(reference[0], whole, symlinks=True)
    r = run(cfg, whole, "config.CHECKPOINT.OVERWRITE_EXISTING=true", "config.OPTIMIZER.num_epochs=4")
    assert r.returncode == 0 and "resumed from" in r.stdout + r.stderr, r.stderr[-3000:]
    assert "has no line for" not in r.stdout + r.stderr


def test_a_vissl_iteration_checkpoint_at_the_last_batch_of_an_epoch_is_that_epochs_end():
    """VISSL lowers the counters of an iteration checkpoint; one written at the epoch's last batch
    (iteration 6 of 6 per epoch, counters -1) is the end of train phase 0, not a position outside
    the epoch (which trained that epoch again)."""
    from ssl_engine.resume_state import from_vissl

    data = {"phase_idx": -1, "train_phase_idx": -1, "iteration": 6, "iteration_num": 7,
            "classy_state_dict": {"train": True, "base_model": {}, "optimizer": {}, "phase_idx": -1,
                                  "train_phase_idx": -1}}
    state = from_vissl(data, 6, "x.torch")
    assert (state["phase_idx"], state["train_phase_idx"], state["phase_complete"], state["local_iteration_num"]) == \
        (0, 0, True, 0)
    data.update(iteration=2)  # 2 batches into train phase 0
    state = from_vissl(data, 6, "x.torch")
    assert (state["train_phase_idx"], state["phase_complete"], state["local_iteration_num"]) == (0, False, 2)


def test_a_moco_queue_of_another_size_is_one_line(tmp_path):
    """The checkpoint's MoCo queue (embedding_dim x queue_size) against another config.LOSS.moco_loss:
    one line naming the keys, exit 2 (was a RuntimeError traceback when the hook attached the encoder)."""
    base = ["config=quick/moco_synthetic", f"config.CHECKPOINT.DIR={tmp_path}", "config.DATA.TRAIN.DATA_LIMIT=16",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=0"]
    assert run_tool([*base, "config.OPTIMIZER.num_epochs=1"]).returncode == 0
    r = run_tool([*base, "config.OPTIMIZER.num_epochs=2", "config.CHECKPOINT.OVERWRITE_EXISTING=true",
                  "config.LOSS.moco_loss.queue_size=32"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "the checkpoint's MoCo queue is [" in line and "resume with the checkpoint's embedding_dim and queue_size" \
        in line, line


def test_with_gradient_accumulation_checkpoints_wait_for_the_update_and_resume_bitwise(setup, tmp_path):
    """GRAD_ACCUMULATION_STEPS=4 over 6 batches an epoch updates at batches 4 and 6 of each epoch.
    A checkpoint between updates lost the gradients accumulated so far (they are not saved), so
    a run resumed from it trained differently: iteration and preemption checkpoints now wait for
    the step that ends the accumulation."""
    root, cfg = setup
    accum = ["config.TRAINER.GRAD_ACCUMULATION_STEPS=4"]
    ref = tmp_path / "ref"
    r = run(cfg, ref, *accum)
    assert r.returncode == 0, r.stderr[-3000:]
    # ITER_FREQUENCY 2 is due at iterations 2, 4, ...: those mid-accumulation (2, 8, 14) move to 4, 10, 16
    written = sorted(int(p.stem[len("model_iteration"):]) for p in ref.glob("model_iteration*.torch"))
    assert written and all((i % ITERS_PER_EPOCH) in (0, 4) for i in written), written
    folder = tmp_path / "killed"
    r = run(cfg, folder, *accum, kill="step:9")  # the newest save before the kill: iteration 6's, not 8's
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert not (folder / "model_iteration8.torch").exists()
    r = run(cfg, folder, *accum, kill="term:13")  # signalled at local batch 1: saved at batch 4 (iteration 16)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "at iteration 16" in r.stderr + r.stdout and (folder / "model_iteration16.torch").exists()
    r = run(cfg, folder, *accum)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bitwise_equal(tensors_of(ref / "checkpoint.torch"), tensors_of(folder / "checkpoint.torch"))
    assert losses(ref) == losses(folder)


@pytest.mark.parametrize("log_every", [10, 3])  # 3: rows flushed before the checkpoint and rows kept in it
def test_a_killed_run_keeps_the_param_groups_rows_of_the_iterations_before_its_checkpoint(setup, tmp_path, log_every):
    """HOOKS.LOG_PARAM_GROUPS keeps its rows in memory between flushes (every LOG_FREQUENCY
    iterations): the rows of the iterations before the checkpoint a killed run resumes from are
    on disk, so the resumed run's param_groups.json has every iteration once, as an
    uninterrupted run's, each checkpoint writing them first (was: the rows of iterations 0-3
    missing after a kill at iteration 5)."""
    root, cfg = setup
    extra = ["config.HOOKS.LOG_PARAM_GROUPS=true", f"config.LOG_FREQUENCY={log_every}", "config.CHECKPOINT.ASYNC_WRITE=false"]
    r = run(cfg, tmp_path / "whole", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    folder = tmp_path / "killed"
    r = run(cfg, folder, *extra, kill="step:5")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    r = run(cfg, folder, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    whole = (tmp_path / "whole" / "param_groups.json").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in whole] == list(range(ITERS_PER_EPOCH * EPOCHS))
    assert (folder / "param_groups.json").read_text().splitlines() == whole
