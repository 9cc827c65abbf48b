"""SLURM through submitit: the sbatch script a config produces (with stand-in sbatch/srun),
and whole jobs on submitit's LocalExecutor (SLURM.EXECUTOR=local): one runs to completion,
one is interrupted by submitit's time-limit/preemption signal, requeued, and finishes from
its checkpoint with exactly the weights of the uninterrupted one.
"""

import json
import os
import pickle
import re
import signal
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import processes_left, run_tool
from ssl_engine.cli import main

SUPERVISED = [
    "config=quick/supervised_digits",
    "config.OPTIMIZER.num_epochs=2",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[3072,32]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[32,10]}]]",
    "config.DATA.TRAIN.DATA_LIMIT=256",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16",
    "config.DATA.TEST.DATA_LIMIT=100",
    "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
    "config.SLURM.USE_SLURM=true",
]


def one_line_error(args: List[str], capsys: pytest.CaptureFixture) -> str:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and err[-1].startswith("error: "), err
    return err[-1]


def test_unknown_executor_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = one_line_error(SUPERVISED + ["config.SLURM.EXECUTOR=cloud", f"config.CHECKPOINT.DIR={tmp_path}"], capsys)
    assert "config.SLURM.EXECUTOR='cloud'" in line and "local" in line


def test_no_sbatch_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no srun
    line = one_line_error(SUPERVISED + [f"config.CHECKPOINT.DIR={tmp_path}"], capsys)
    assert "sbatch" in line and "config.SLURM.EXECUTOR=local" in line


def test_local_executor_is_one_node(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = one_line_error(SUPERVISED + [
        "config.SLURM.EXECUTOR=local", "config.DISTRIBUTED.NUM_NODES=2", f"config.CHECKPOINT.DIR={tmp_path}",
    ], capsys)
    assert "NUM_NODES=1" in line


@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_a_log_folder_that_cannot_be_made_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch, executor: str) -> None:
    """submitit makes SLURM.LOG_FOLDER when the executor is built: one under a file (or in /proc)
    was a FileNotFoundError traceback. The part before submitit's %j is checked before submitting."""
    fake_slurm(tmp_path / "bin", 7)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    (tmp_path / "a_file").write_text("x")
    line = one_line_error(SUPERVISED + [f"config.SLURM.EXECUTOR={executor}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
                                        f"config.SLURM.LOG_FOLDER={tmp_path / 'a_file' / '%j'}"], capsys)
    assert line == f"error: config.SLURM.LOG_FOLDER={tmp_path / 'a_file'} is a file, not a folder; name a folder for the run's files"
    assert not (tmp_path / "run").exists()


def fake_slurm(bin_dir: Path, job_id: int) -> None:
    """sbatch/srun stand-ins: sbatch answers like SLURM and runs nothing."""
    bin_dir.mkdir()
    for name, body in (("sbatch", f'echo "Submitted batch job {job_id}"'), ("srun", "exit 0")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_sbatch_script_from_config(tmp_path: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path / "bin", 4242)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    logs = tmp_path / "logs"
    code = main([
        "config=quick/supervised_digits", f"config.CHECKPOINT.DIR={tmp_path / 'ckpt'}",
        "config.MACHINE.DEVICE=gpu", "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=8",
        "config.SLURM.USE_SLURM=true", "config.SLURM.NAME=my_run", "config.SLURM.PARTITION=learn",
        "config.SLURM.TIME_HOURS=2", "config.SLURM.TIME_MINUTES=30", "config.SLURM.MEM_GB=200",
        "config.SLURM.CONSTRAINT=volta32gb", "config.SLURM.COMMENT=deadline", "config.SLURM.NUM_CPU_PER_PROC=6",
        "config.SLURM.SIGNAL_DELAY_S=120", f"config.SLURM.LOG_FOLDER={logs}",
        "+config.SLURM.ADDITIONAL_PARAMETERS.exclusive=true",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert "submitted job 4242" in out and f"logs in {logs}" in out
    script = (logs / "4242_submission.sh").read_text()
    for line in (
        "#SBATCH --job-name=my_run", "#SBATCH --partition=learn", "#SBATCH --time=150", "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=48",
        "#SBATCH --mem=200GB", "#SBATCH --constraint=volta32gb", "#SBATCH --comment=deadline",
        "#SBATCH --signal=USR2@120", "#SBATCH --exclusive",
    ):
        assert line in script, script
    assert (logs / "4242_submitted.pkl").exists()


# ----------------------------------------------------------------------------- local executor

PAUSE = '''
import os, time
from pathlib import Path
from ssl_engine import preemption
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS

@HOOKS.register("PauseUntilPreempted")
class PauseUntilPreempted(SSLHook):
    """Once (a marker file remembers), at train iteration `iteration`, wait until asked to stop."""

    def __init__(self, iteration: int, marker: str) -> None:
        super().__init__()
        self.iteration, self.marker = iteration, Path(marker)

    def on_step(self, task):
        if task.train and task.iteration == self.iteration and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            deadline = time.time() + 240
            while not preemption.requested() and time.time() < deadline:
                time.sleep(0.05)
'''


def submit_local(tmp_path: Path, name: str, marker: Path, env: Dict[str, str]) -> str:
    """Submit one job to the local executor; returns its job id (the controller's pid)."""
    proc = run_tool(SUPERVISED + [
        "config.SLURM.EXECUTOR=local", "config.SLURM.TIME_HOURS=0", "config.SLURM.TIME_MINUTES=20",
        f"config.SLURM.LOG_FOLDER={tmp_path / name / 'logs'}", f"config.CHECKPOINT.DIR={tmp_path / name / 'ckpt'}",
        f"config.USER_MODULES=[{tmp_path / 'pause.py'}]",
        f"config.HOOKS.CUSTOM=[{{name:PauseUntilPreempted,params:{{iteration:5,marker:{marker}}}}}]",
    ], env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = re.search(r"submitted job (\d+) \(local, ssl_engine\); logs in (\S+)", proc.stdout)
    assert m and Path(m.group(2)) == tmp_path / name / "logs", proc.stdout
    return m.group(1)


def children_of(pid: int) -> List[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.2)


def job_result(folder: Path, job_id: str, timeout: float = 400) -> Any:
    path = folder / "logs" / f"{job_id}_0_result.pkl"
    wait_for(path, timeout)
    time.sleep(0.2)
    status, value = pickle.loads(path.read_bytes())
    log_out = (folder / "logs" / f"{job_id}_0_log.out").read_text()
    assert status == "success", f"{value}\n{log_out[-3000:]}"
    return value


def model_tensors(path: Path) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out[prefix] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)

    walk("", torch.load(path, weights_only=True)["classy_state_dict"]["base_model"])
    return out


def test_local_jobs_complete_and_a_preempted_job_resumes_exactly(tmp_path: Path) -> None:
    (tmp_path / "pause.py").write_text(PAUSE)
    marker_value = uuid.uuid4().hex
    env = {"SSL_ENGINE_TEST_MARKER": marker_value}
    never = tmp_path / "never_pause"
    never.write_text("the uninterrupted job does not pause")
    paused = tmp_path / "paused"
    whole = submit_local(tmp_path, "whole", never, env)
    interrupted = submit_local(tmp_path, "interrupted", paused, env)
    try:
        # the interrupted job waits at iteration 5: send submitit's time-limit/preemption signal to its task
        wait_for(paused, 300)
        tasks = children_of(int(interrupted))
        assert len(tasks) == 1, tasks
        os.kill(tasks[0], signal.SIGUSR2)
        assert "finished" in job_result(tmp_path / "interrupted", interrupted)
        assert "finished" in job_result(tmp_path / "whole", whole)
    finally:
        for job in (whole, interrupted):
            try:
                os.kill(int(job), signal.SIGTERM)  # no-op when the controller is already gone
            except ProcessLookupError:
                pass
    log_out = (tmp_path / "interrupted" / "logs" / f"{interrupted}_0_log.out").read_text()
    assert "asking the ranks to checkpoint" in log_out and f"Requeued job {interrupted}" in log_out
    assert "resumed from" in log_out and "model_iteration5.torch" in log_out
    assert (tmp_path / "interrupted" / "ckpt" / "model_iteration5.torch").exists()
    assert not (tmp_path / "whole" / "ckpt" / "model_iteration5.torch").exists()

    ckpt = "model_final_checkpoint_phase1.torch"
    a = model_tensors(tmp_path / "whole" / "ckpt" / ckpt)
    b = model_tensors(tmp_path / "interrupted" / "ckpt" / ckpt)
    assert a and a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    metrics = [[json.loads(x) for x in (tmp_path / n / "ckpt" / "metrics.json").read_text().splitlines()]
               for n in ("whole", "interrupted")]
    assert metrics[0] == metrics[1]

    assert processes_left(marker_value, 15) == []
