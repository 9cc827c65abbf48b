"""Distributed runs through the real tool: spawned gloo ranks, torchrun, two "nodes" on one
machine, ranks that fail together, and the sampler padding that keeps metrics exact.

Every multi-process test compares with a one-process run over the same global batch: an
mlp trunk without BatchNorm makes the two computations the same up to float rounding.
"""

import json
import math
import os
import pickle
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from conftest import REPO, TOOL, free_port, processes_left, processes_with, run_tool, tool_env
from ssl_engine.config import compose
from ssl_engine.data.sampler import PaddedIndex, StatefulDistributedSampler, is_padded
from ssl_engine.errors import ConfigError
from ssl_engine.launch import init_method_for, remove_temp_files_of
from ssl_engine.preemption import PREEMPTED_WAIT_S
from ssl_engine.train_steps.standard_train_step import real_rows

# A supervised run whose 1-rank and N-rank computations agree: no BatchNorm, TRAIN data a
# multiple of the global batch (64), TEST data (201) that does not divide among 2 ranks and
# spans several test batches, so padding and per-batch weighting both matter.
SUPERVISED = [
    "config=quick/supervised_digits",
    "config.OPTIMIZER.num_epochs=2",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[3072,32]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[32,10]}]]",
    "config.DATA.TRAIN.DATA_LIMIT=256",
    "config.DATA.TEST.DATA_LIMIT=201",
    "config.LOG_FREQUENCY=2",
]


def per_rank(world: int, train_batch: int = 64, test_batch: int = 64) -> List[str]:
    """The same global batches split over ``world`` ranks."""
    return [
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={world}",
        f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={train_batch // world}",
        f"config.DATA.TEST.BATCHSIZE_PER_REPLICA={test_batch // world}",
    ]


def read_metrics(folder: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.json").read_text().splitlines()]


def leaves(record: Any, prefix: str = "") -> Dict[str, float]:
    if isinstance(record, dict):
        out: Dict[str, float] = {}
        for k, v in record.items():
            out.update(leaves(v, f"{prefix}/{k}"))
        return out
    return {prefix: float(record)}


def assert_same_metrics(a: List[Dict[str, Any]], b: List[Dict[str, Any]], rel: float = 1e-5) -> None:
    """Every phase record of ``a`` and ``b`` has the same keys and values within float tolerance."""
    assert [r["phase_idx"] for r in a] == [r["phase_idx"] for r in b]
    for ra, rb in zip(a, b):
        la, lb = leaves(ra), leaves(rb)
        assert la.keys() == lb.keys()
        for key in la:
            assert la[key] == pytest.approx(lb[key], rel=rel, abs=1e-6), f"phase {ra['phase_idx']} {key}"


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def one_rank_metrics(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    """The reference: one process, global batch 64."""
    folder = tmp_path_factory.mktemp("one_rank")
    ok(run_tool(SUPERVISED + per_rank(1) + [f"config.CHECKPOINT.DIR={folder}"]))
    records = read_metrics(folder)
    assert [r["phase_idx"] for r in records] == [0, 1, 2, 3]
    return records


# ----------------------------------------------------------------------------- unit


def test_fork_ranks_start_after_the_weights_file_is_checked_before_launch(tmp_path: Path) -> None:
    """The pre-launch check reads MODEL.WEIGHTS_INIT.PARAMS_FILE (its finite check runs on every
    tensor) in the tool process; ranks forked from it (MULTI_PROCESSING_METHOD: fork, the quick
    configs' method) then run the same check. Was: that large op started OpenMP's thread team in
    the tool process and both forked ranks waited forever on its barrier, SIGTERM ignored."""
    from ssl_engine.models import build_model

    cfg = compose(SUPERVISED)
    weights = tmp_path / "weights.torch"
    torch.save(build_model(cfg.MODEL, cfg.OPTIMIZER).state_dict(), weights)  # fc1: 3072 x 32, above OpenMP's grain
    r = run_tool(SUPERVISED + per_rank(2) + ["config.MULTI_PROCESSING_METHOD=fork", "config.OPTIMIZER.num_epochs=1",
                                             f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights}",
                                             f"config.CHECKPOINT.DIR={tmp_path / 'run'}"],
                 env={"OMP_NUM_THREADS": "2"}, timeout=240)  # the tests' usual 1 thread would hide it
    assert r.returncode == 0, r.stderr[-3000:]
    assert "initialised weights from" in (tmp_path / "run" / "log.txt").read_text()
    assert (tmp_path / "run" / "model_final_checkpoint_phase0.torch").is_file()


@pytest.mark.parametrize("n,world", [(201, 2), (200, 2), (7, 4), (1, 3), (10, 3)])
def test_sampler_marks_padding_and_every_sample_is_real_once(n: int, world: int) -> None:
    real: List[int] = []
    lengths = set()
    for rank in range(world):
        s = StatefulDistributedSampler(n, num_replicas=world, rank=rank, shuffle=True, seed=3, batch_size=2)
        s.set_epoch(1)
        keys = list(s)
        lengths.add(len(keys))
        real += [k[1] for k in keys if not is_padded(k)]
        s.set_start_iter(1)  # a resumed phase marks the same positions
        assert [is_padded(k) for k in s] == [is_padded(k) for k in keys[2:]]
    assert len(lengths) == 1  # equal steps on every rank
    assert sorted(real) == list(range(n))
    key = PaddedIndex(4, 9)
    assert key == (4, 9) and tuple(key) == (4, 9)
    assert is_padded(pickle.loads(pickle.dumps(key)))  # travels to dataloader workers as a padded key


def test_real_rows_counts_and_masks_padded_and_replaced_samples() -> None:
    assert real_rows({"data_valid": [torch.tensor([1, 1, 1])]}) == (3, None)
    n, mask = real_rows({"data_valid": [torch.tensor([1, 0, -1, 1])]})
    assert n == 2
    assert mask.tolist() == [True, False, False, True]
    assert real_rows({"data": [torch.zeros(2)]}) == (None, None)
    n, mask = real_rows({"data_valid": [torch.tensor([1.0, float("nan")])]})  # a NaN flag is not a real row
    assert n == 1 and mask.tolist() == [True, False]


def test_init_method_checks() -> None:
    cfg = compose(["config=quick/supervised_digits", "config.DISTRIBUTED.NUM_NODES=2"])
    with pytest.raises(ConfigError, match="config.DISTRIBUTED.RUN_ID must be host:port"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.RUN_ID = "nohostport"
    with pytest.raises(ConfigError, match=r"is not host:port of node 0 \(e\.g\. 10\.0\.0\.1:29500\)$"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.NUM_NODES = 1  # VISSL's configs for one node leave a placeholder: auto is what they mean
    with pytest.raises(ConfigError, match="is not host:port of node 0 .*; on one node, auto .the default. needs no address"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.NUM_NODES = 2
    cfg.DISTRIBUTED.RUN_ID = "10.0.0.1:29500"
    assert init_method_for(cfg) == ("tcp://10.0.0.1:29500", None)
    # one node with RUN_ID=auto, tcp or file: a file in a fresh folder, no port another job could take
    cfg.DISTRIBUTED.NUM_NODES, cfg.DISTRIBUTED.RUN_ID = 1, "auto"
    for method in ("tcp", "file"):
        cfg.DISTRIBUTED.INIT_METHOD = method
        url, folder = init_method_for(cfg)
        assert folder and Path(folder).is_dir() and url == f"file://{folder}/rendezvous"
        os.rmdir(folder)
    cfg.DISTRIBUTED.NUM_NODES = 2
    cfg.DISTRIBUTED.INIT_METHOD, cfg.DISTRIBUTED.RUN_ID = "file", "auto"
    with pytest.raises(ConfigError, match="shares"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.NUM_NODES = 1
    cfg.DISTRIBUTED.INIT_METHOD = "env"
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.INIT_METHOD = "file"
    url, folder = init_method_for(cfg)
    assert url.startswith("file://") and folder and Path(folder).is_dir()
    os.rmdir(folder)


def test_rendezvous_addresses_the_ranks_cannot_meet_at_are_refused_before_launch(tmp_path: Path) -> None:
    """Port 0 (a random port no other rank can know) hung; a file RUN_ID in a missing folder made
    torch wait five minutes and fail with a traceback; a folder failed with a traceback; a file
    left by a killed run sent the new ranks to that run's dead ones (a gloo traceback)."""
    cfg = compose(["config=quick/supervised_digits", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"])
    for port in ("0", "65536"):
        cfg.DISTRIBUTED.RUN_ID = f"localhost:{port}"
        with pytest.raises(ConfigError, match=f"port {port} is not a port the ranks can meet at; give one in 1-65535"):
            init_method_for(cfg)
    cfg.DISTRIBUTED.RUN_ID = "localhost:65535"
    assert init_method_for(cfg) == ("tcp://localhost:65535", None)
    cfg.DISTRIBUTED.INIT_METHOD = "file"
    cfg.DISTRIBUTED.RUN_ID = str(tmp_path)
    with pytest.raises(ConfigError, match="is a folder; with INIT_METHOD=file it names the file"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.RUN_ID = str(tmp_path / "missing" / "rdzv")
    with pytest.raises(ConfigError, match=f"its folder {tmp_path / 'missing'} does not exist"):
        init_method_for(cfg)
    stale = tmp_path / "rdzv"
    stale.write_bytes(b"\x00" * 40)
    cfg.DISTRIBUTED.RUN_ID = str(stale)
    with pytest.raises(ConfigError, match="already holds 40 bytes, left by a run that did not end"):
        init_method_for(cfg)
    cfg.DISTRIBUTED.NUM_NODES = 2  # another node's ranks may have written it already
    assert init_method_for(cfg) == (f"file://{stale}", None)
    cfg.DISTRIBUTED.NUM_NODES = 1
    stale.write_bytes(b"")  # an empty file is a new one
    assert init_method_for(cfg) == (f"file://{stale}", None)


def test_a_rendezvous_port_in_use_is_one_line(tmp_path: Path) -> None:
    """Rank 0 could not listen on RUN_ID's port: a DistNetworkError traceback (EADDRINUSE)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_tool(SUPERVISED + per_rank(2) + [f"config.CHECKPOINT.DIR={tmp_path}", "config.DISTRIBUTED.INIT_METHOD=tcp",
                                                 f"config.DISTRIBUTED.RUN_ID=localhost:{port}"], timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert f"the port of tcp://localhost:{port} (config.DISTRIBUTED.RUN_ID) is in use on this node" in r.stderr


@pytest.mark.parametrize("env,message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "environment variable RANK='x' is not a whole number >= 0"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "environment variable RANK=1 must be below WORLD_SIZE=1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "environment variable LOCAL_RANK='-1' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "x"}, "environment variable WORLD_SIZE='x' is not a whole number >= 0"),
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": None},
     "environment variable(s) RANK=3, WORLD_SIZE=2 set without LOCAL_RANK: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE"),
    ({"RANK": "1", "LOCAL_RANK": None}, "environment variable(s) RANK=1 set without WORLD_SIZE and LOCAL_RANK"),
])
def test_torchrun_variables_set_by_hand_are_checked(tmp_path: Path, env: Dict[str, str], message: str) -> None:
    """A RANK of 'x' was a ValueError traceback; RANK=1 of WORLD_SIZE=1 trained as rank 0; a
    WORLD_SIZE of 'x' was a ValueError traceback; RANK and WORLD_SIZE without LOCAL_RANK were
    ignored, and the tool trained a world of its own (None: the variable is not set)."""
    given = {"LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29599", **env}
    r = run_tool(SUPERVISED + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}"],
                 env={k: v for k, v in given.items() if v is not None})
    assert r.returncode == 2, r.stderr[-3000:]
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "checkpoint.torch").exists()


def test_remove_temp_files_only_of_given_ranks(tmp_path: Path) -> None:
    mine, other = tmp_path / ".model_phase0.torch.tmp.111", tmp_path / ".metrics.json.tmp.222"
    mine.write_text("x")
    other.write_text("x")
    (tmp_path / "model_phase0.torch").write_text("x")
    assert remove_temp_files_of(tmp_path, [111]) == [mine.name]
    assert other.exists() and (tmp_path / "model_phase0.torch").exists()


# ----------------------------------------------------------------------------- user errors


def one_line_error(args: List[str], capsys: pytest.CaptureFixture) -> str:
    """Run the command line in this process (the checks come before any process starts)."""
    from ssl_engine.cli import main

    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err, err
    assert err[-1].startswith("error: ")
    return err[-1]


def test_several_nodes_without_run_id_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = one_line_error(SUPERVISED + [
        "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=1", f"config.CHECKPOINT.DIR={tmp_path}",
    ], capsys)
    assert "config.DISTRIBUTED.RUN_ID" in line and "host:port" in line


def test_sync_bn_on_cpu_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = one_line_error(SUPERVISED + per_rank(2) + [
        "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=true", f"config.CHECKPOINT.DIR={tmp_path}",
    ], capsys)
    assert "CONVERT_BN_TO_SYNC_BN" in line and "cpu" in line


def test_node_id_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = one_line_error(SUPERVISED + [
        "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
        f"config.DISTRIBUTED.RUN_ID=127.0.0.1:{free_port()}", "node_id=2", f"config.CHECKPOINT.DIR={tmp_path}",
    ], capsys)
    assert "node_id=2" in line and "NUM_NODES=2" in line


# ----------------------------------------------------------------------------- equal results

PROBE = '''
import gc, json, logging, os
import torch
import torch.distributed as dist
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS

@HOOKS.register("RankProbe")
class RankProbe(SSLHook):
    """Rank 1 logs a warning; at the end rank 0 writes what every rank saw."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def on_start(self, task):
        if task.rank == 1:
            logging.getLogger("probe").warning("probe warning from rank 1")
            logging.getLogger("probe").info("probe info from rank 1")
        self.bn_before_forward = None
        bns = [m for m in task.base_model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if bns:  # the running mean as the train forward sees it, after DDP's buffer broadcast
            bns[0].register_forward_pre_hook(self._record)

    def _record(self, module, inputs):
        if module.training:
            self.bn_before_forward = float(module.running_mean.double().sum())

    def on_end(self, task):
        m = task.base_model
        seen = {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "env_rank": os.environ.get("RANK"),
            "seed": torch.initial_seed(),
            "broadcast_buffers": bool(getattr(task.model, "broadcast_buffers", None)),
            "bn_before_forward": self.bn_before_forward,
            "params": float(sum(p.double().sum() for p in m.parameters())),
            "gc": [gc.isenabled(), gc.get_freeze_count()],
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, seen)
        if dist.get_rank() == 0:
            open(self.out, "w").write(json.dumps(everyone))
'''


def probe_args(tmp_path: Path) -> List[str]:
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "probe.json"
    return [
        f"config.USER_MODULES=[{tmp_path / 'probe.py'}]",
        f"config.HOOKS.CUSTOM=[{{name:RankProbe,params:{{out:{out}}}}}]",
    ]


def test_two_ranks_equal_one_rank(tmp_path: Path, one_rank_metrics: List[Dict[str, Any]]) -> None:
    folder = tmp_path / "run"
    proc = ok(run_tool(SUPERVISED + per_rank(2) + [f"config.CHECKPOINT.DIR={folder}"] + probe_args(tmp_path)))
    assert_same_metrics(read_metrics(folder), one_rank_metrics)
    # test phases: 201 samples counted once each (padding left out), not 202
    test_top1 = [r["test_accuracy_list_meter"]["top_1"]["0"] for r in one_rank_metrics if "test_loss" in r]
    assert all(abs(v * 201 / 100 - round(v * 201 / 100)) < 1e-3 for v in test_top1)
    # only rank 0 writes; rank 1's warnings (not its info lines) still reach the console
    assert "probe warning from rank 1" in proc.stderr and "[rank 1]" in proc.stderr
    assert "probe info from rank 1" not in proc.stdout + proc.stderr
    log_txt = (folder / "log.txt").read_text()
    assert "probe warning from rank 1" not in log_txt and "[rank 1]" not in log_txt
    lines = [json.loads(x) for x in (folder / "stdout.json").read_text().splitlines()]
    assert len({l["iteration"] for l in lines if l["phase_type"] == "train"}) == len(
        [l for l in lines if l["phase_type"] == "train"]), "a log line was written twice"
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert [s["rank"] for s in seen] == [0, 1] and [s["env_rank"] for s in seen] == ["0", "1"]
    assert [s["seed"] for s in seen] == [0, 1]  # SEED_VALUE (0) + rank
    assert seen[0]["params"] == seen[1]["params"]  # DDP kept the replicas identical
    # forked from the tool's process after its imports: the collector on, the imports frozen
    assert all(s["gc"][0] and s["gc"][1] > 50000 for s in seen), [s["gc"] for s in seen]
    assert not [p.name for p in folder.iterdir() if ".tmp." in p.name]


def test_two_ranks_resumed_mid_phase_log_what_an_uninterrupted_run_logs(
    tmp_path: Path, one_rank_metrics: List[Dict[str, Any]]
) -> None:
    """Each rank's meter counts and loss sum of the interrupted phase come back to that rank; a
    rerun of the finished folder, and of one whose final checkpoint was damaged, ends in step."""
    folder = tmp_path / "run"
    args = SUPERVISED + per_rank(2) + [f"config.CHECKPOINT.DIR={folder}", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=3",
                                       "config.CHECKPOINT.ASYNC_WRITE=false"]
    ok(run_tool(args))
    # cut the folder back to what a kill during iteration 7 leaves: 4 iterations per train phase,
    # the newest checkpoint after iteration 6 (in phase 2), metrics.json with phases 0 and 1
    for name in ("model_phase1.torch", "model_final_checkpoint_phase1.torch"):
        (folder / name).unlink(missing_ok=True)
    (folder / "checkpoint.torch").unlink()
    (folder / "checkpoint.torch").symlink_to("model_iteration6.torch")
    (folder / "metrics.json").write_text("".join(l + "\n" for l in (folder / "metrics.json").read_text().splitlines()[:2]))
    ok(run_tool(args))
    assert_same_metrics(read_metrics(folder), one_rank_metrics)
    # the folder now holds a finished run: rank 0 judges its final checkpoint and both ranks act on
    # its answer, even where rank 1 would judge the file otherwise (it trained on, rank 0 did not)
    apart = tmp_path / "apart.py"
    apart.write_text(
        "import torch.distributed as dist\n"
        "import ssl_engine.checkpoint as checkpoint\n"
        "import ssl_engine.engines.train as train\n"
        "judge = checkpoint.checkpoint_problem\n"
        "apart = lambda path: ('judged apart', None) if dist.get_rank() else judge(path)\n"
        "checkpoint.checkpoint_problem = train.checkpoint_problem = apart\n"
    )
    # a rank that lost its way waits in a collective: one minute, not thirty, before the run fails
    apart_args = args + [f"config.USER_MODULES=[{apart}]", "config.DISTRIBUTED.TIMEOUT_MINUTES=1"]
    again = run_tool(apart_args)
    ok(again)
    assert "has finished (model_final_checkpoint_phase1.torch exists)" in again.stdout + again.stderr
    assert "judged apart" not in again.stdout + again.stderr
    # damaged after the run: rank 0 chooses the newest good checkpoint and both ranks resume from
    # that file (rank 1 would have found none and trained from scratch), and end as one rank does
    final = folder / "model_final_checkpoint_phase1.torch"
    final.write_bytes(final.read_bytes()[:1000])
    again = run_tool(apart_args)
    ok(again)
    assert "model_final_checkpoint_phase1.torch cannot be used" in again.stdout + again.stderr
    assert "has finished" not in again.stdout + again.stderr and torch.load(str(final), weights_only=False)
    assert "judged apart" not in again.stdout + again.stderr
    assert_same_metrics(read_metrics(folder), one_rank_metrics)
    # a rank that cannot read the file rank 0 chose (a folder the nodes do not share) stops the run
    unshared = tmp_path / "unshared.py"
    unshared.write_text(
        "import torch.distributed as dist\n"
        "import ssl_engine.engines.train as train\n"
        "from ssl_engine.errors import CheckpointError\n"
        "read = train.load_checkpoint\n"
        "def load(path):\n"
        "    if dist.get_rank():\n"
        "        raise CheckpointError(f'{path} does not exist')\n"
        "    return read(path)\n"
        "train.load_checkpoint = load\n"
    )
    final.write_bytes(final.read_bytes()[:1000])
    stopped = run_tool(args + [f"config.USER_MODULES=[{unshared}]", "config.DISTRIBUTED.TIMEOUT_MINUTES=1"])
    assert stopped.returncode == 2, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert ("error: rank 1: cannot read the checkpoint rank 0 resumes from" in stopped.stderr
            and "config.CHECKPOINT.DIR must be a folder that all nodes share" in stopped.stderr), stopped.stderr[-2000:]


def test_torchrun_equals_one_rank(tmp_path: Path, one_rank_metrics: List[Dict[str, Any]]) -> None:
    """torchrun starts the ranks (env://); the config's NUM_PROC_PER_NODE=1 loses to WORLD_SIZE=2."""
    folder = tmp_path / "run"
    args = SUPERVISED + per_rank(2) + ["config.DISTRIBUTED.NUM_PROC_PER_NODE=1", f"config.CHECKPOINT.DIR={folder}"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TOOL, *args],
        cwd=str(REPO), env=tool_env(), capture_output=True, text=True, timeout=300,
    )
    ok(proc)
    assert "WORLD_SIZE=2 wins over the config's DISTRIBUTED.NUM_NODES=1 x NUM_PROC_PER_NODE=1" in proc.stdout + proc.stderr
    assert_same_metrics(read_metrics(folder), one_rank_metrics)
    saved = (folder / "train_config.yaml").read_text()
    assert "NUM_PROC_PER_NODE: 2" in saved


def test_two_nodes_on_one_machine_equal_one_rank(tmp_path: Path, one_rank_metrics: List[Dict[str, Any]]) -> None:
    folder = tmp_path / "run"
    args = SUPERVISED + per_rank(2) + [
        "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
        f"config.DISTRIBUTED.RUN_ID=127.0.0.1:{free_port()}", f"config.CHECKPOINT.DIR={folder}",
    ]
    nodes = [
        subprocess.Popen([sys.executable, TOOL, *args, f"node_id={k}"], cwd=str(REPO), env=tool_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for k in (1, 0)
    ]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert_same_metrics(read_metrics(folder), one_rank_metrics)


SIMCLR = [
    "config=quick/simclr_synthetic",
    "config.OPTIMIZER.num_epochs=2",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[3072,32]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[32,32,16]}]]",
    "config.LOSS.simclr_info_nce_loss.buffer_params.embedding_dim=16",
    "config.DATA.TRAIN.DATA_LIMIT=32",
]


def test_simclr_two_ranks_see_every_negative(tmp_path: Path) -> None:
    """Each rank's rows are compared with the embeddings of both ranks: the 2-rank loss (and the
    gradients, hence the next steps) equal the 1-rank loss over the same 16 images per step."""
    runs = {}
    for world in (1, 2):
        folder = tmp_path / f"w{world}"
        ok(run_tool(SIMCLR + [
            f"config.DISTRIBUTED.NUM_PROC_PER_NODE={world}", f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={16 // world}",
            f"config.CHECKPOINT.DIR={folder}",
        ]))
        runs[world] = read_metrics(folder)
    assert_same_metrics(runs[2], runs[1])
    # with only local negatives (7 per row instead of 15) the loss would be clearly lower
    assert runs[2][0]["train_loss"] > math.log(15) - 0.7


def test_logged_train_loss_leaves_out_the_padding_of_an_uneven_split(tmp_path: Path) -> None:
    """37 train images over 2 ranks: rank 1's last batch holds a padded repeat. The step trains on
    it, but the logged train loss is the mean over the 37 real images, as one process logs it
    (lr 0: the same weights at every step). Was: the repeat's loss was inside rank 1's batch mean,
    2.29231 against 2.29103."""
    args = SUPERVISED + ["config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=37",
                         "config.DATA.TEST.DATA_LIMIT=37", "config.OPTIMIZER.param_schedulers.lr.start_value=0",
                         "config.OPTIMIZER.param_schedulers.lr.end_value=0", "config.OPTIMIZER.weight_decay=0"]
    runs = {}
    for world in (1, 2):
        folder = tmp_path / f"w{world}"
        ok(run_tool(args + per_rank(world, train_batch=8, test_batch=8) + [f"config.CHECKPOINT.DIR={folder}"]))
        runs[world] = read_metrics(folder)
    assert_same_metrics(runs[2], runs[1])


def test_test_only_ranks_test_rank_0s_model(tmp_path: Path) -> None:
    """TEST_ONLY with no weights file: the random init of a 2-rank run is rank 0's on both ranks,
    as DDP makes it for a training run, so the test numbers are those of one process. Was: each
    rank tested its own init (seeded SEED_VALUE + rank): test loss 2.45136 over 2 ranks where one
    process gives 2.43152 (heads scaled up so that random logits differ clearly)."""
    args = SUPERVISED + ["config.TEST_ONLY=true", "config.DATA.TEST.DATA_LIMIT=37",
                         "config.MODEL.HEAD.PARAMS_MULTIPLIER=20"]
    runs = {}
    for world in (1, 2):
        folder = tmp_path / f"w{world}"
        ok(run_tool(args + per_rank(world, test_batch=8) + [f"config.CHECKPOINT.DIR={folder}"]))
        runs[world] = read_metrics(folder)
    assert [r["phase_idx"] for r in runs[1]] == [0]
    assert_same_metrics(runs[2], runs[1])


@pytest.mark.parametrize("loss, collator", [("simclr", "simclr_collator"), ("moco", "moco_collator")])
def test_contrastive_test_phase_over_an_uneven_split_gets_whole_batches(tmp_path: Path, loss: str, collator: str) -> None:
    """7 test images over 2 ranks in batches of 4: rank 1's batch holds a padded repeat. A loss
    that compares the rows of a step (SimCLR's negatives gathered from every rank) or holds state
    of them (MoCo's keys) is given the whole batch. Was: it was given the 3 real rows, and the
    gather of 4 rows from one rank and 3 from the other aborted the run (gloo: "Received data size
    doesn't match expected size"); MoCo's 3 queries met 4 keys ("size of tensor a (3) must match")."""
    test = (f"+config.DATA.TEST={{DATA_SOURCES:[synthetic],LABEL_TYPE:sample_index,DATA_LIMIT:7,BATCHSIZE_PER_REPLICA:4,"
            f"COLLATE_FUNCTION:{collator},TRANSFORMS:[{{name:ImgReplicatePil,num_times:2}},{{name:ToTensor}}]}}")
    args = [f"config=quick/{loss}_synthetic", "config.OPTIMIZER.num_epochs=1", "config.MODEL.TRUNK.NAME=mlp",
            "config.MODEL.TRUNK.MLP.DIMS=[3072,32]", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[32,64]}]]",
            "config.TEST_MODEL=true", test, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DISTRIBUTED.TIMEOUT_MINUTES=1",
            f"config.CHECKPOINT.DIR={tmp_path / 'run'}"]
    ok(run_tool(args))
    records = read_metrics(tmp_path / "run")
    assert [r["phase_idx"] for r in records] == [0, 1] and math.isfinite(records[1]["test_loss"])


@pytest.mark.parametrize("broadcast", [True, False])
def test_broadcast_buffers(tmp_path: Path, broadcast: bool) -> None:
    """With BatchNorm, BROADCAST_BUFFERS keeps rank 0's running stats on every rank; without it
    each rank keeps the statistics of its own half batch."""
    args = SUPERVISED + per_rank(2) + probe_args(tmp_path) + [
        "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false", "config.MODEL.TRUNK.MLP.USE_BN=true",
        f"config.DISTRIBUTED.BROADCAST_BUFFERS={str(broadcast).lower()}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
    ]
    ok(run_tool(args))
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert [s["broadcast_buffers"] for s in seen] == [broadcast, broadcast]
    assert seen[0]["bn_before_forward"] is not None
    assert (seen[0]["bn_before_forward"] == seen[1]["bn_before_forward"]) is broadcast
    assert seen[0]["params"] == seen[1]["params"]


EMA_PROBE = '''
import json
import torch.distributed as dist
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS

@HOOKS.register("EmaBufferProbe")
class EmaBufferProbe(SSLHook):
    """At the end of each test phase, every rank's sum of its EMA model's BatchNorm statistics."""

    def __init__(self, out):
        super().__init__()
        self.out, self.seen = out, []

    def on_phase_end(self, task):
        if not task.train:
            ema = next(h for h in task.hooks if type(h).__name__ == "EMAModelHook")
            stats = float(sum(b.double().sum() for b in ema.ema_model.buffers() if b.is_floating_point()))
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, stats)
            self.seen.append(everyone)

    def on_end(self, task):
        if dist.get_rank() == 0:
            open(self.out, "w").write(json.dumps(self.seen))
'''


def test_every_rank_tests_the_ema_model_with_rank_0s_batchnorm_statistics(tmp_path: Path) -> None:
    """With BROADCAST_BUFFERS each rank's model runs with rank 0's BatchNorm statistics, and a
    checkpoint holds rank 0's EMA model; the EMA test meters of every rank use those statistics
    too. Was: each rank averaged its own model's statistics (updated by its own half batch after
    the broadcast), so rank 1 tested another EMA model than the checkpoint's (sums 4300.96 and
    4295.67 on a resnet18), and a resumed run's rank 1 another than an uninterrupted one's."""
    (tmp_path / "probe.py").write_text(EMA_PROBE)
    out = tmp_path / "probe.json"
    ok(run_tool(SUPERVISED + per_rank(2) + [
        "config.OPTIMIZER.num_epochs=2", "config.MODEL.TRUNK.MLP.USE_BN=true",
        "config.HOOKS.EMA_MODEL.ENABLE_EMA_METERS=true", "config.HOOKS.EMA_MODEL.DECAY=0.5",
        f"config.USER_MODULES=[{tmp_path / 'probe.py'}]",
        f"config.HOOKS.CUSTOM=[{{name:EmaBufferProbe,params:{{out:{out}}}}}]", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
    ]))
    seen = json.loads(out.read_text())
    assert len(seen) == 2 and all(rank0 == rank1 for rank0, rank1 in seen), seen


# ----------------------------------------------------------------------------- failing together

FAILING = '''
import os, signal, time
from pathlib import Path
import torch.distributed as dist
from ssl_engine.registry import TRAIN_STEPS
from ssl_engine.train_steps.standard_train_step import standard_train_step

@TRAIN_STEPS.register("fail_on_rank1_step")
def fail_on_rank1_step(task):
    at = int(os.environ["FAIL_AT_ITER"])
    if task.train and task.iteration == at:
        if dist.get_rank() == 1:
            Path(os.environ["FAIL_STAMP"]).write_text(repr(time.time()))
            raise RuntimeError(f"deliberate failure on rank 1 at iteration {task.iteration}")
        # rank 0 is stuck where SIGINT cannot reach it, halfway through writing a file
        Path(task.checkpoint_folder, f".model_iteration{at}.torch.tmp.{os.getpid()}").write_bytes(b"partial")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            time.sleep(0.1)
    standard_train_step(task)
'''


def test_rank_failure_ends_the_job(tmp_path: Path) -> None:
    (tmp_path / "failing.py").write_text(FAILING)
    folder, tmpdir, stamp = tmp_path / "run", tmp_path / "tmpdir", tmp_path / "failed_at"
    tmpdir.mkdir()
    marker = f"SSL_ENGINE_TEST_MARKER={uuid.uuid4().hex}"
    env = {"FAIL_AT_ITER": "3", "FAIL_STAMP": str(stamp), "TMPDIR": str(tmpdir), marker.split("=")[0]: marker.split("=")[1]}
    proc = run_tool(SUPERVISED + per_rank(2) + [
        f"config.CHECKPOINT.DIR={folder}", f"config.USER_MODULES=[{tmp_path / 'failing.py'}]",
        "config.TRAINER.TRAIN_STEP_NAME=fail_on_rank1_step", "config.DATA.NUM_DATALOADER_WORKERS=1",
    ], env=env, timeout=300)
    ended = time.time()
    assert proc.returncode not in (0, None)
    assert ended - float(stamp.read_text()) < 60
    assert "rank 1 failed first" in proc.stderr and "deliberate failure on rank 1 at iteration 3" in proc.stderr
    assert processes_left(marker, 10) == []
    assert [p.name for p in folder.iterdir() if ".tmp." in p.name or p.name.endswith(".lock")] == []
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("ssl_engine_")] == []


WAITING = '''
import os, time
from pathlib import Path
import torch.distributed as dist
from ssl_engine.registry import TRAIN_STEPS
from ssl_engine.train_steps.standard_train_step import standard_train_step

@TRAIN_STEPS.register("fail_on_rank1_wait_on_rank0")
def fail_on_rank1_wait_on_rank0(task):
    if task.train and task.iteration == 2:
        waiting = Path(os.environ["STOPPED_STAMP"] + ".waiting")
        if dist.get_rank() == 1:
            while not waiting.exists():  # fail only once rank 0 is inside its wait
                time.sleep(0.05)
            raise RuntimeError("deliberate failure on rank 1")
        try:
            waiting.touch()
            while True:  # in Python: the launcher's SIGINT unwinds it
                time.sleep(0.05)
        except KeyboardInterrupt:
            Path(os.environ["STOPPED_STAMP"]).write_text("interrupted")
            raise
    standard_train_step(task)
'''


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_job_started_with_sigint_ignored_still_stops_its_ranks_cleanly(tmp_path: Path, method: str) -> None:
    """A script's background job inherits SIGINT ignored. The launcher's stop (SIGINT to the
    surviving ranks after a failure) must still unwind them, not wait for the SIGKILL."""
    (tmp_path / "waiting.py").write_text(WAITING)
    stamp = tmp_path / "stopped"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, TOOL, *SUPERVISED, *per_rank(2), f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
         f"config.USER_MODULES=[{tmp_path / 'waiting.py'}]", f"config.MULTI_PROCESSING_METHOD={method}",
         "config.TRAINER.TRAIN_STEP_NAME=fail_on_rank1_wait_on_rank0"],
        cwd=str(REPO), env=tool_env({"STOPPED_STAMP": str(stamp)}), capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.returncode == 1 and "deliberate failure on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert stamp.exists(), f"rank 0 was not unwound by SIGINT (killed after {time.monotonic() - start:.0f} s)"
    assert [p.name for p in (tmp_path / "run").iterdir() if ".tmp." in p.name or p.name.endswith(".lock")] == []


SLOW_AND_MARKED = '''
import os, time
from pathlib import Path
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS

@HOOKS.register("SlowAndMarked")
class SlowAndMarked(SSLHook):
    def on_step(self, task):
        Path(os.environ["STARTED_STAMP"]).touch()
        time.sleep(0.3)
'''


def test_a_job_started_with_sigint_ignored_keeps_ignoring_ctrl_c(tmp_path: Path) -> None:
    """Like a one-process run (and every program), a launcher that inherited SIGINT ignored
    leaves a Ctrl-C alone: the job trains to its end."""
    (tmp_path / "slow.py").write_text(SLOW_AND_MARKED)
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, TOOL, *SUPERVISED, *per_rank(2), f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
         f"config.USER_MODULES=[{tmp_path / 'slow.py'}]", "config.HOOKS.CUSTOM=[{name:SlowAndMarked}]",
         "config.TEST_MODEL=false"],
        cwd=str(REPO), env=tool_env({"STARTED_STAMP": str(started)}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), proc.communicate()[1][-3000:]
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "run" / "model_final_checkpoint_phase1.torch").exists()


class _Tool:
    """The tool with Ctrl-C at its default (a foreground command) and ``marker`` in its
    environment; a thread collects its merged output so the test can wait for a line."""

    def __init__(self, args: List[str], marker: str, env: Dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, TOOL, *args], cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=tool_env({**env, marker.split("=")[0]: marker.split("=")[1]}), text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.seen = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line)
        self.lines.put("")  # the end

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if not line:
                raise AssertionError(f"no {text!r} (exit {self.proc.poll()}):\n{self.seen[-3000:]}")
            self.seen += line

    def wait_for_files(self, files: List[Path], timeout: float = 240) -> None:
        """Until every one of ``files`` exists (the ranks got there); fails if the tool ends first."""
        deadline = time.monotonic() + timeout
        while not all(f.exists() for f in files):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.end(0)[-3000:]
            time.sleep(0.1)

    def end(self, timeout: float) -> str:
        """Wait for the exit (kill after ``timeout``) and return the whole output."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=10)
            while not self.lines.empty():
                self.seen += self.lines.get()
        return self.seen


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 3)], ids=["ctrl_c", "preemption"])
def test_a_stop_reaches_ranks_waiting_for_a_node_that_never_comes(tmp_path: Path, sig: int, code: int) -> None:
    """Node 0 of two, and node 1 never starts: the ranks wait inside torch's rendezvous, where
    no Python signal handler runs, for TIMEOUT_MINUTES. A Ctrl-C must still end the job at
    once (exit 130), a preemption signal after PREEMPTED_WAIT_S (exit 3: nothing to save,
    rerunning starts the run)."""
    marker = f"SSL_ENGINE_TEST_MARKER={uuid.uuid4().hex}"
    tool = _Tool(SUPERVISED + [
        "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
        f"config.DISTRIBUTED.RUN_ID=127.0.0.1:{free_port()}", "node_id=0", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
    ], marker, {})
    try:
        tool.wait_for("waiting for the 2 ranks to join")
        time.sleep(1.0)  # inside the C++ wait by now
        sent = time.monotonic()
        tool.proc.send_signal(sig)
    finally:
        out = tool.end(timeout=PREEMPTED_WAIT_S + 30)
    assert tool.proc.returncode == code, out[-3000:]
    waited = time.monotonic() - sent
    assert waited < 15 if sig == signal.SIGINT else PREEMPTED_WAIT_S - 1 < waited < PREEMPTED_WAIT_S + 15
    assert f"stopped by {signal.Signals(sig).name} while waiting for the 2 ranks to join" in out
    assert processes_left(marker, 10) == []


SLOW_TO_STOP = '''
import os, time
from pathlib import Path
from ssl_engine.registry import TRAIN_STEPS

@TRAIN_STEPS.register("slow_to_stop_on_rank1")
def slow_to_stop_on_rank1(task):
    rank = os.environ["RANK"]
    Path(os.environ["STARTED_STAMP"] + rank).touch()
    try:
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        if rank == "1":  # as a rank finishing a long checkpoint write
            time.sleep(12)
            Path(os.environ["STOPPED_STAMP"]).touch()
        raise
'''


def test_one_ctrl_c_lets_every_rank_finish_stopping(tmp_path: Path) -> None:
    """Rank 0 stops at once, rank 1 needs 12 s (more than KILL_GRACE_SECONDS): after one Ctrl-C
    the launcher waits for it, instead of counting rank 0's exit as a failure and killing rank 1."""
    (tmp_path / "slow.py").write_text(SLOW_TO_STOP)
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    tool = _Tool(SUPERVISED + per_rank(2) + [
        f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{tmp_path / 'slow.py'}]",
        "config.TRAINER.TRAIN_STEP_NAME=slow_to_stop_on_rank1",
    ], f"SSL_ENGINE_TEST_MARKER={uuid.uuid4().hex}", {"STARTED_STAMP": str(started), "STOPPED_STAMP": str(stopped)})
    try:
        tool.wait_for_files([Path(f"{started}{r}") for r in (0, 1)])
        tool.proc.send_signal(signal.SIGINT)
    finally:
        out = tool.end(timeout=60)
    assert tool.proc.returncode == 130, out[-3000:]
    assert stopped.exists(), f"rank 1 was killed before it had stopped:\n{out[-3000:]}"
    assert out.rstrip().endswith("interrupted") and "Traceback" not in out


DEAF_TO_CTRL_C = '''
import os, signal, time
from pathlib import Path
from ssl_engine.registry import TRAIN_STEPS

@TRAIN_STEPS.register("deaf_to_ctrl_c")
def deaf_to_ctrl_c(task):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a rank blocked in C code behaves
    Path(os.environ["STARTED_STAMP"] + str(os.environ["RANK"])).touch()
    while True:
        time.sleep(0.05)
'''


def test_ctrl_c_twice_kills_ranks_that_do_not_stop(tmp_path: Path) -> None:
    """The first Ctrl-C asks the ranks to stop and says how to force it; ranks that do not
    stop (blocked in C code) are killed by a second Ctrl-C, exit 130."""
    (tmp_path / "deaf.py").write_text(DEAF_TO_CTRL_C)
    started = tmp_path / "started"
    marker = f"SSL_ENGINE_TEST_MARKER={uuid.uuid4().hex}"
    tool = _Tool(SUPERVISED + per_rank(2) + [
        f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{tmp_path / 'deaf.py'}]",
        "config.TRAINER.TRAIN_STEP_NAME=deaf_to_ctrl_c",
    ], marker, {"STARTED_STAMP": str(started)})
    try:
        tool.wait_for_files([Path(f"{started}{r}") for r in (0, 1)])
        tool.proc.send_signal(signal.SIGINT)
        tool.wait_for("Ctrl-C again to kill them now", timeout=30)
        time.sleep(2.0)
        assert tool.proc.poll() is None, "the ranks were killed before the second Ctrl-C"
        tool.proc.send_signal(signal.SIGINT)
    finally:
        out = tool.end(timeout=30)
    assert tool.proc.returncode == 130, out[-3000:]
    assert "killing 2 rank(s) still running" in out and "interrupted" in out
    assert "Traceback" not in out and "SIGKILL" not in out
    assert processes_left(marker, 10) == []


# ----------------------------------------------------------------------------- startup

PID_PROBE = '''
import json, os
from ssl_engine.hooks.base import SSLHook
from ssl_engine.registry import HOOKS

@HOOKS.register("PidProbe")
class PidProbe(SSLHook):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def on_start(self, task):
        open(self.out, "w").write(json.dumps({"pid": os.getpid(), "env_rank": os.environ.get("RANK")}))
'''


def test_one_process_run_runs_in_the_launched_process(tmp_path: Path) -> None:
    """NUM_PROC_PER_NODE=1 trains in the tool's own process: no second interpreter that would
    import torch again."""
    (tmp_path / "pid_probe.py").write_text(PID_PROBE)
    out = tmp_path / "pid.json"
    args = SUPERVISED + per_rank(1) + [
        "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
        f"config.USER_MODULES=[{tmp_path / 'pid_probe.py'}]",
        f"config.HOOKS.CUSTOM=[{{name:PidProbe,params:{{out:{out}}}}}]",
    ]
    proc = subprocess.Popen([sys.executable, TOOL, *args], cwd=str(REPO), env=tool_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen == {"pid": proc.pid, "env_rank": None}


def test_forkserver_loader_workers_start_from_a_preloaded_server() -> None:
    """With MULTI_PROCESSING_METHOD=forkserver the loader asks the forkserver to import torch and
    the data modules once, so that its workers do not each import them; a preload list set
    elsewhere is kept."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    from ssl_engine.data.loader import build_dataloader
    from ssl_engine.forkserver import FORKSERVER_PRELOAD

    before = list(forkserver._forkserver._preload_modules)
    try:
        mp.set_forkserver_preload(["__main__", "json"])
        cfg = {"MULTI_PROCESSING_METHOD": "forkserver",
               "DATA": {"NUM_DATALOADER_WORKERS": 1, "TRAIN": {"BATCHSIZE_PER_REPLICA": 2}}}
        build_dataloader(list(range(8)), cfg, "TRAIN", 0, 1, "cpu")
        assert forkserver._forkserver._preload_modules == ["__main__", "json", *FORKSERVER_PRELOAD]
        mp.set_forkserver_preload(["__main__"])
        cfg["MULTI_PROCESSING_METHOD"] = "fork"
        build_dataloader(list(range(8)), cfg, "TRAIN", 0, 1, "cpu")
        assert forkserver._forkserver._preload_modules == ["__main__"]
    finally:
        mp.set_forkserver_preload(before)


def test_forkserver_ranks_and_workers_equal_one_rank(tmp_path: Path, one_rank_metrics: List[Dict[str, Any]]) -> None:
    """The default start method: ranks and loader workers come from forkservers that preloaded
    torch (the launcher starts its own right after composing the config); same results."""
    folder = tmp_path / "run"
    ok(run_tool(SUPERVISED + per_rank(2) + [
        f"config.CHECKPOINT.DIR={folder}", "config.MULTI_PROCESSING_METHOD=forkserver",
        "config.DATA.NUM_DATALOADER_WORKERS=1",
    ] + probe_args(tmp_path)))
    assert_same_metrics(read_metrics(folder), one_rank_metrics)
    # a rank from the forkserver paused its own collector while importing the engine, then froze
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert all(s["gc"][0] and s["gc"][1] > 50000 for s in seen), [s["gc"] for s in seen]


def long_temp_dir(tmp_path: Path) -> Path:
    """A temp dir of 90 characters: multiprocessing's sockets under it would pass Linux's 107 bytes."""
    folder = tmp_path / "t"
    folder = Path(str(folder) + "x" * max(1, 90 - len(str(folder))))
    folder.mkdir()
    return folder


@pytest.mark.parametrize("ranks,method", [(2, "forkserver"), (1, "fork")])
def test_ranks_and_workers_run_under_a_temp_dir_too_long_for_sockets(tmp_path: Path, ranks: int, method: str) -> None:
    """Loader workers pass batches as file descriptors through a socket multiprocessing binds in
    the temp dir; under a long TMPDIR (a cluster's per-job folder) the bind failed in the
    worker's queue thread and the ranks waited for their first batch forever (the forkserver
    could not start at all). The sockets now go to a short folder, with a warning, and the run
    ends normally."""
    tmpdir = long_temp_dir(tmp_path)
    folder = tmp_path / "run"
    base = [o for o in SUPERVISED if "DATA_LIMIT" not in o and "num_epochs" not in o]
    proc = run_tool(base + per_rank(ranks) + [
        "config.DATA.TRAIN.DATA_LIMIT=128", "config.DATA.TEST.DATA_LIMIT=64", "config.OPTIMIZER.num_epochs=1",
        f"config.CHECKPOINT.DIR={folder}", f"config.MULTI_PROCESSING_METHOD={method}",
        "config.DATA.NUM_DATALOADER_WORKERS=1",
    ], env={"TMPDIR": str(tmpdir)}, timeout=240)
    ok(proc)
    line = next(ln for ln in proc.stdout.splitlines() if "too long for the sockets" in ln)
    assert str(tmpdir) in line
    moved = Path(line.rsplit(" they go to ", 1)[1].split(" instead")[0])
    assert len(str(moved)) < 30 and not moved.exists()  # removed when the run ended
    assert [m["phase_idx"] for m in read_metrics(folder)] == [0, 1]


def test_a_temp_dir_too_long_for_sockets_with_nowhere_else_is_a_user_error(tmp_path: Path) -> None:
    code = (
        "from ssl_engine.socket_dir import ensure_short_socket_dir\n"
        "from ssl_engine.errors import UserError\n"
        "try:\n    ensure_short_socket_dir(bases=('/nonexistent-folder',))\n"
        "except UserError as e:\n    print('UserError:', e)\n"
    )
    tmpdir = long_temp_dir(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=tool_env({"TMPDIR": str(tmpdir)}),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"UserError: the temp dir {tmpdir} (")
    assert "set TMPDIR to a folder of at most 75 characters" in proc.stdout
    short = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=tool_env({"TMPDIR": str(tmp_path)}),
                           capture_output=True, text=True, timeout=60)
    assert short.returncode == 0 and short.stdout == ""  # a short temp dir: nothing to do


@pytest.mark.parametrize("ranks, workers, epochs", [(1, 2, 50), (2, 1, 500)], ids=["one-rank", "two-ranks"])
def test_a_killed_forkserver_launcher_leaves_no_process(tmp_path: Path, ranks: int, workers: int, epochs: int) -> None:
    """SIGKILL of the launcher alone (the OOM killer, `kill -9 <pid>`) of a run whose ranks (two
    ranks) or loader workers (one rank) come from a forkserver: the workers, which ignore SIGTERM,
    the ranks and the forkserver end on their own within seconds. PR_SET_PDEATHSIG watched a
    forkserver rank's parent, the forkserver, which every rank keeps alive: the two ranks trained
    on to the end, writing checkpoints into the folder a rerun resumes from."""
    marker = f"SSL_ENGINE_TEST_MARKER={uuid.uuid4().hex}"
    folder = tmp_path / "run"
    base = [o for o in SUPERVISED if not o.startswith("config.OPTIMIZER.num_epochs")]
    cmd = [sys.executable, str(TOOL), *base, *(per_rank(ranks) if ranks > 1 else []), f"config.CHECKPOINT.DIR={folder}",
           "config.MULTI_PROCESSING_METHOD=forkserver", f"config.DATA.NUM_DATALOADER_WORKERS={workers}",
           f"config.OPTIMIZER.num_epochs={epochs}"]
    env = tool_env({marker.split("=")[0]: marker.split("=")[1]})
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while not (folder / "stdout.json").exists() and time.time() < deadline:  # training has started
            time.sleep(0.2)
        assert (folder / "stdout.json").exists(), "the run did not start training"
        children = [p for p in processes_with(marker) if p != proc.pid]
        assert len(children) >= 1 + ranks * workers  # the forkserver and every rank's workers
        proc.kill()  # the launcher only, not its process group
        proc.wait()
        assert processes_left(marker, 20) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_nccl_keys_set_the_environment_of_the_ranks(tmp_path: Path) -> None:
    """DISTRIBUTED.NCCL_DEBUG and NCCL_SOCKET_NTHREADS reach the ranks' environment (as VISSL sets
    them); a value the shell already exports wins; an out-of-range thread count is one line, exit 2."""
    (tmp_path / "envprobe.py").write_text(
        "import json, os\n"
        "def show(task):\n"
        f"    open({str(tmp_path / 'env.json')!r}, 'w').write(json.dumps({{k: os.environ.get(k) for k in "
        "('NCCL_DEBUG', 'NCCL_SOCKET_NTHREADS')}))\n")
    base = ["config=quick/simclr_synthetic", "config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=8",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=0",
            f"config.USER_MODULES=[{tmp_path / 'envprobe.py'}]",
            "+config.HOOKS.CUSTOM=[{name: CallbackHook, params: {on_start: 'envprobe:show'}}]"]
    clean = {k: v for k, v in tool_env().items() if not k.startswith("NCCL_")}
    r = subprocess.run([sys.executable, TOOL, *base, f"config.CHECKPOINT.DIR={tmp_path / 'a'}",
                        "config.DISTRIBUTED.NCCL_DEBUG=true", "config.DISTRIBUTED.NCCL_SOCKET_NTHREADS=4"],
                       cwd=str(REPO), env=clean, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "env.json").read_text()) == {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_NTHREADS": "4"}
    r = subprocess.run([sys.executable, TOOL, *base, f"config.CHECKPOINT.DIR={tmp_path / 'b'}",
                        "config.DISTRIBUTED.NCCL_DEBUG=true"], cwd=str(REPO), env={**clean, "NCCL_DEBUG": "WARN"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "env.json").read_text()) == {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_NTHREADS": None}
    r = run_tool([*base, f"config.CHECKPOINT.DIR={tmp_path / 'c'}", "config.DISTRIBUTED.NCCL_SOCKET_NTHREADS=64"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: config.DISTRIBUTED.NCCL_SOCKET_NTHREADS='64' must be an integer from 1 to 16 (NCCL's range), or empty "
        "to leave NCCL's default")


def test_a_killed_launchers_rendezvous_folder_is_removed_by_the_next_launcher(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot remove its rendezvous folder (in /dev/shm); the next
    one removes the folders of launchers that no longer run, and leaves a live one's alone."""
    import socket

    from ssl_engine.launch import RDZV_PREFIX, launcher_temp_dir

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    gone = tmp_path / f"{RDZV_PREFIX}{host}_{dead.pid}_abc123"
    live = tmp_path / f"{RDZV_PREFIX}{host}_{os.getppid()}_def456"
    other_host = tmp_path / f"{RDZV_PREFIX}other-node_{dead.pid}_ghi012"  # a shared temp dir: not ours to judge
    unnamed = tmp_path / f"{RDZV_PREFIX}xyz789"
    for folder in (gone, live, other_host, unnamed):
        folder.mkdir()
        (folder / "rendezvous").write_text("")
    new = Path(launcher_temp_dir(RDZV_PREFIX, str(tmp_path)))
    assert new.name.startswith(f"{RDZV_PREFIX}{host}_{os.getpid()}_") and new.is_dir()
    assert not gone.exists() and live.exists() and other_host.exists() and unnamed.exists()


class _EndedRank:
    def __init__(self, exitcode: int) -> None:
        self.exitcode, self.pid = exitcode, None

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: Any = None) -> None:
        pass


@pytest.mark.parametrize("seen_first", [0, 1])
def test_the_rank_that_failed_first_is_reported_whichever_exit_the_launcher_saw_first(tmp_path: Path, seen_first: int) -> None:
    """Rank 0 raised a user error; its closing connections made rank 1 fail a moment later. Rank 0
    may still be exiting when the launcher's poll sees rank 1's exit (a loaded machine): the job
    must still end with rank 0's one line and exit code 2, not rank 1's connection traceback."""
    from ssl_engine.errors import UserError
    from ssl_engine.launch import RankGroup

    cfg = compose(["config=quick/simclr_synthetic", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"])
    group = RankGroup(cfg)
    group._error_dir = str(tmp_path)
    (tmp_path / "rank0.err").write_text("100.0\n2\nconfig.DATA.TRAIN: image b/fake.png cannot be read")
    (tmp_path / "rank1.err").write_text("100.4\n1\nTraceback ...\nRuntimeError: Connection closed by peer\n")
    group.procs = [_EndedRank(2), _EndedRank(1)]
    group.cause = seen_first
    with pytest.raises(UserError, match=r"^rank 0: config.DATA.TRAIN: image b/fake.png cannot be read$"):
        group._report()


def test_a_rank_that_died_of_a_signal_after_the_first_failure_does_not_take_its_blame(tmp_path: Path) -> None:
    """Rank 0's user error was seen first; rank 1 then died of a signal (no error file, e.g. an
    abort in a collective) before the launcher stopped it: rank 0's line is still the job's."""
    from ssl_engine.errors import UserError
    from ssl_engine.launch import RankGroup

    group = RankGroup(compose(["config=quick/simclr_synthetic", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]))
    group._error_dir = str(tmp_path)
    (tmp_path / "rank0.err").write_text("100.0\n2\nconfig.DATA.TRAIN: image b/fake.png cannot be read")
    group.procs = [_EndedRank(2), _EndedRank(-signal.SIGABRT)]
    group.cause, group._seen_failed = 0, [0]
    with pytest.raises(UserError, match=r"^rank 0: config.DATA.TRAIN: image b/fake.png cannot be read$"):
        group._report()
    group._seen_failed = [0, 1]  # seen ended together: a rank killed from outside comes first, as before
    group.cause = 1
    assert group._report() == 1


def test_a_stop_sent_while_a_rank_starts_is_reported_not_a_traceback(tmp_path: Path) -> None:
    """The launcher stops the other ranks (SIGINT) when one fails at once, e.g. rank 0 finding
    RUN_ID's port taken; a rank still starting held SIGINT blocked, and unblocking it raised the
    KeyboardInterrupt before the rank's try: multiprocessing printed "Process rank1: Traceback"
    (seen under load in test_a_rendezvous_port_in_use_is_one_line). The rank now reports
    "interrupted" like any stop."""
    code = textwrap.dedent(f"""\
        import os, signal
        from ssl_engine import launch
        from ssl_engine.config import compose
        from ssl_engine.distributed import RankInfo
        cfg = compose(["config=quick/supervised_digits", "config.MULTI_PROCESSING_METHOD=fork"])
        signal.pthread_sigmask(signal.SIG_BLOCK, launch._HELD_WHILE_STARTING)  # as the launcher starts ranks
        os.kill(os.getpid(), signal.SIGINT)  # the stop, pending until the rank unblocks it
        launch._child(cfg, RankInfo(rank=1, local_rank=1, world_size=2), 2, {str(tmp_path)!r}, os.getppid())
        """)
    r = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=tool_env(), capture_output=True, text=True,
                       timeout=120)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 130, r.stderr[-3000:]
    assert (tmp_path / "rank1.err").read_text().splitlines()[1:] == ["130", "interrupted"]
