"""Engine core, end to end through the real tool and in-process: phases, train step, registry."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, run_tool, tool_env
from ssl_engine.config import compose
from ssl_engine.errors import NonFiniteLossError, UserError
from ssl_engine.registry import Registry

TINY = [
    "config.MACHINE.DEVICE=cpu",
    "config.DISTRIBUTED.NUM_PROC_PER_NODE=1",
    "config.DATA.NUM_DATALOADER_WORKERS=0",
    "config.DATA.TRAIN.DATA_SOURCES=[synthetic]",
    "config.DATA.TRAIN.LABEL_SOURCES=[synthetic]",
    "config.DATA.TRAIN.DATA_LIMIT=32",
    "config.DATA.TRAIN.SYNTHETIC_IMAGE_SIZE=4",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
    "config.DATA.TRAIN.TRANSFORMS=[{name: ToTensor}]",
    "config.DATA.TEST.DATA_SOURCES=[synthetic]",
    "config.DATA.TEST.LABEL_SOURCES=[synthetic]",
    "config.DATA.TEST.DATA_LIMIT=16",
    "config.DATA.TEST.SYNTHETIC_IMAGE_SIZE=4",
    "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8",
    "config.DATA.TEST.TRANSFORMS=[{name: ToTensor}]",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[48,16]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}]]",
    "config.LOSS.name=cross_entropy_multiple_output_single_target",
    "config.METERS.names=[accuracy_list_meter]",
    "config.OPTIMIZER.num_epochs=2",
    "config.OPTIMIZER.param_schedulers.lr.name=constant",
    "config.OPTIMIZER.param_schedulers.lr.value=0.1",
]


def tiny_task(tmp_path, *overrides):
    """A prepared task built in-process from the tiny config (no hooks)."""
    from ssl_engine.engines.run import load_builtin_parts
    from ssl_engine.tasks import build_task

    load_builtin_parts()
    cfg = compose(TINY + [f"config.CHECKPOINT.DIR={tmp_path}", *overrides])
    torch.manual_seed(0)
    task = build_task(cfg)
    task.prepare()
    task.set_hooks([])
    return task


@pytest.mark.parametrize("checked", [False, True], ids=["trainer-only", "names-checked-first"])
def test_a_trainer_built_in_python_finds_the_built_in_parts_without_the_tool(tmp_path, checked):
    """Python API use (README, Your own parts): a fresh process that composes a config and runs
    SelfSupervisionTrainer itself has imported no module that registers 'standard_train_step'
    (the registry must), nor made the run folder (the trainer must). With the tool's check of
    the config's names called first (which imports the built-in parts itself), the same."""
    check = "check_registered_names(cfg)\n" if checked else ""
    script = (
        "import json, sys\n"
        "from ssl_engine.config import compose\n"
        "from ssl_engine.config.validate import check_registered_names\n"
        "cfg = compose(json.loads(sys.argv[1]))\n"
        + check +
        "from ssl_engine.hooks import default_hooks\n"
        "from ssl_engine.trainer import SelfSupervisionTrainer\n"
        "task = SelfSupervisionTrainer(cfg, hooks=default_hooks(cfg)).train()\n"
        "print('iteration', task.iteration)\n"
    )
    folder = tmp_path / "new" / "run"  # not there yet: the tool's logging makes it, so must the trainer
    args = json.dumps(TINY + [f"config.CHECKPOINT.DIR={folder}"])
    r = subprocess.run([sys.executable, "-c", script, args], cwd=str(REPO), env=tool_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration 8" in r.stdout  # 2 epochs of 32 samples in batches of 8
    assert {"metrics.json", "model_final_checkpoint_phase1.torch"} <= {p.name for p in folder.iterdir()}


def test_run_training_from_python_twice_in_one_folder_behaves_as_the_tool(tmp_path, caplog):
    """The Python API run twice in one folder: the second call sees the finished run and leaves it
    (the tool's "has finished" line, nothing written), as the tool does; the bare trainer refuses
    to train from scratch over it (it overwrote the final checkpoint and metrics.json silently)."""
    from ssl_engine.engines.train import run_training
    from ssl_engine.hooks import default_hooks
    from ssl_engine.trainer import SelfSupervisionTrainer

    folder = tmp_path / "run"
    cfg = compose(TINY + [f"config.CHECKPOINT.DIR={folder}"])
    task = run_training(cfg)
    assert task.iteration == 8 and (folder / "train_config.yaml").is_file()
    final = folder / "model_final_checkpoint_phase1.torch"
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()}
    with caplog.at_level(logging.INFO):
        assert run_training(compose(TINY + [f"config.CHECKPOINT.DIR={folder}"])) is None
    assert f"the run in {folder} has finished ({final.name} exists); nothing to do" in caplog.text
    with pytest.raises(UserError, match=f"holds a finished run \\({final.name}\\); SelfSupervisionTrainer.train"):
        cfg = compose(TINY + [f"config.CHECKPOINT.DIR={folder}"])
        SelfSupervisionTrainer(cfg, hooks=default_hooks(cfg)).train()
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()} == before
    # with more epochs it trains on from the final checkpoint, as the tool does
    more = run_training(compose(TINY + [f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=3",
                                        "config.CHECKPOINT.OVERWRITE_EXISTING=true"]))
    assert more.iteration == 12


def run_phase(task):
    task.advance_phase()
    while True:
        try:
            task.train_step_fn(task)
        except StopIteration:
            break
    task.phase_complete = True


# -- through the tool ------------------------------------------------------------------------


def test_quick_simclr_synthetic_writes_the_run_folder(tmp_path):
    folder = tmp_path / "run1"
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    names = {p.name for p in folder.iterdir()}
    assert {"train_config.yaml", "log.txt", "stdout.json", "metrics.json", "model_phase0.torch",
            "model_final_checkpoint_phase1.torch", "checkpoint.torch"} <= names
    assert (folder / "checkpoint.torch").resolve().name == "model_final_checkpoint_phase1.torch"
    metrics = [json.loads(x) for x in (folder / "metrics.json").read_text().splitlines()]
    assert [m["train_phase_idx"] for m in metrics] == [0, 1]
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in metrics)
    steps = [json.loads(x) for x in (folder / "stdout.json").read_text().splitlines()]
    # LOG_FREQUENCY 2, 4 iterations per epoch; as in VISSL also iteration 1 and every 5th up to 100
    assert [s["iteration"] for s in steps] == [1, 2, 4, 5, 6, 8]
    assert {"lr", "loss", "data_time", "batch_time", "eta"} <= set(steps[0])
    assert "train phase 0" in (folder / "log.txt").read_text()
    assert "engine, config:" not in (folder / "log.txt").read_text()  # only with VERBOSE
    ckpt = torch.load(str(folder / "checkpoint.torch"), weights_only=True)
    assert {"phase_idx", "train_phase_idx", "iteration", "iteration_num", "type", "classy_state_dict"} <= set(ckpt)
    assert ckpt["iteration"] == 8 and ckpt["type"] == "final"
    assert set(ckpt["classy_state_dict"]["base_model"]["model"]) == {"trunk", "heads"}
    # the resolved config composes again, unchanged
    saved = compose([f"config={folder / 'train_config.yaml'}"], warn_unused=False)
    assert saved.OPTIMIZER.num_epochs == 2 and saved.CHECKPOINT.DIR == str(folder)
    assert yaml.safe_load((folder / "train_config.yaml").read_text())["config"]["LOSS"]["name"] == "simclr_info_nce_loss"


def test_verbose_logs_the_full_config_at_start(tmp_path):
    folder = tmp_path / "verbose"
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=1",
                  "config.DATA.TRAIN.DATA_LIMIT=16", "config.VERBOSE=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = (folder / "log.txt").read_text()
    assert "train engine, config:" in log
    dumped = log.split("train engine, config:\n", 1)[1]
    assert "  LOSS:\n    name: simclr_info_nce_loss" in dumped and "  VERBOSE: true" in dumped


def test_supervised_digits_reaches_90_percent(tmp_path):
    folder = tmp_path / "sup"
    r = run_tool(["config=quick/supervised_digits", f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=3"],
                 timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (folder / "metrics.json").read_text().splitlines()]
    tests = [m for m in metrics if "test_accuracy_list_meter" in m]
    assert len(tests) == 3  # a test phase after each of the 3 train phases
    top1 = tests[-1]["test_accuracy_list_meter"]["top_1"]["0"]
    assert top1 >= 90.0, metrics
    # testing the trained classifier from its file (VISSL's "label prediction at the head"): an
    # evaluation loads the file's head only with EVAL_TRUNK_AND_HEAD, else it tests a new head
    # (another seed: with the training's seed the new head is the trained one's init, which a
    # short training leaves close enough for the trunk to still score well through it)
    evaluate = ["config=quick/supervised_digits", "config.TEST_ONLY=true", "config.SEED_VALUE=7",
                f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={folder / 'checkpoint.torch'}",
                "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
                "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD=true"]
    for with_head in (True, False):
        out = tmp_path / f"test_only_{with_head}"
        r = run_tool(evaluate + [f"config.CHECKPOINT.DIR={out}",
                                 f"config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_TRUNK_AND_HEAD={with_head}"], timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        again = json.loads((out / "metrics.json").read_text().splitlines()[-1])["test_accuracy_list_meter"]["top_1"]["0"]
        said = "tests heads that config.MODEL.WEIGHTS_INIT.PARAMS_FILE did not set" in r.stdout + r.stderr
        if with_head:
            assert again == pytest.approx(top1, abs=1e-9) and not said
        else:
            assert again < top1 - 30 and said, (again, top1)
    # a finished test-only run is not run again (its final checkpoint is found like a training's)
    before = (out / "metrics.json").read_text()
    r = run_tool(evaluate + [f"config.CHECKPOINT.DIR={out}"], timeout=600)
    assert r.returncode == 0 and "has finished (model_final_checkpoint_phase-1.torch exists)" in r.stdout + r.stderr
    assert (out / "metrics.json").read_text() == before


def test_vissl_simclr_config_runs_on_two_cpu_processes(tmp_path):
    from PIL import Image

    images = tmp_path / "images"
    for c in ("cat", "dog"):
        (images / c).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (48, 40), (40 * i, 100 if c == "cat" else 30, 7 * i)).save(images / c / f"{i}.png")
    folder = tmp_path / "vissl"
    r = run_tool([
        "config=pretrain/simclr/simclr_8node_resnet", f"config.DATA.TRAIN.DATA_PATHS=[{images}]",
        "config.DATA.TRAIN.DATA_LIMIT=8", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
        "config.DISTRIBUTED.NUM_NODES=1", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.MACHINE.DEVICE=cpu",
        "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=false", "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.OPTIMIZER.num_epochs=1", f"config.CHECKPOINT.DIR={folder}",
    ], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(str(folder / "model_final_checkpoint_phase0.torch"), weights_only=True)
    assert ckpt["iteration"] == 1  # 8 samples / (4 per rank x 2 ranks)
    assert ckpt["classy_state_dict"]["world_size"] == 2
    # auto_lr_scaling: 0.3 x 8/256 peak; the composite schedule starts at 0.6/4.8 of it
    log = (folder / "log.txt").read_text()
    assert "simclr_info_nce_loss" in (folder / "train_config.yaml").read_text()
    assert "train phase 0 done" in log


USER_MODULE = '''
import os
import torch
from torch import nn
from ssl_engine.registry import TRUNKS, LOSSES, TRAIN_STEPS
from ssl_engine.train_steps import standard_train_step
from classy_vision.losses import ClassyLoss


@TRUNKS.register("user_tiny_trunk")
class UserTinyTrunk(nn.Module):
    def __init__(self, model_config, model_name):
        super().__init__()
        self.fc = nn.Linear(48, 16)

    def forward(self, x, out_feat_keys=None):
        return [torch.relu(self.fc(x.flatten(1)))]


@LOSSES.register("user_ce")
class UserCE(ClassyLoss):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.get("scale", 1.0))

    def forward(self, output, target):
        return self.scale * nn.functional.cross_entropy(output[0], target)


@TRAIN_STEPS.register("user_counting_step")
def user_counting_step(task):
    standard_train_step(task)
    with open(os.path.join(task.checkpoint_folder, f"steps_rank{task.rank}.txt"), "a") as f:
        f.write(f"{task.iteration}\\n")
'''


def test_user_modules_register_parts_used_by_two_ranks(tmp_path):
    mod = tmp_path / "my_parts.py"
    mod.write_text(USER_MODULE)
    folder = tmp_path / "user"
    r = run_tool(TINY + [
        f"config.USER_MODULES=[{mod}]", "config.MODEL.TRUNK.NAME=user_tiny_trunk", "config.LOSS.name=user_ce",
        "+config.LOSS.user_ce.scale=0.5", "config.TRAINER.TRAIN_STEP_NAME=user_counting_step",
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.TEST_MODEL=false", f"config.CHECKPOINT.DIR={folder}",
    ])
    assert r.returncode == 0, r.stderr[-3000:]
    # 32 samples, 8 per rank, 2 ranks: 2 iterations per epoch, 2 epochs, on each rank
    for rank in (0, 1):
        assert (folder / f"steps_rank{rank}.txt").read_text().split() == ["1", "2", "3", "4"]
    trunk = torch.load(str(folder / "checkpoint.torch"), weights_only=True)["classy_state_dict"]["base_model"]["model"]["trunk"]
    assert set(trunk) == {"fc.weight", "fc.bias"}


# -- in-process: phases, train step -----------------------------------------------------------


def test_phases_follow_test_every_num_epoch_and_test_only(tmp_path):
    from ssl_engine.tasks.self_supervision_task import build_phases

    cfg = compose(TINY + ["config.OPTIMIZER.num_epochs=5", "config.TEST_EVERY_NUM_EPOCH=2"])
    # VISSL's placement: a test after train phases 0, 2, 4 (idx % N == 0) and after the last
    assert [p["train"] for p in build_phases(cfg)] == [True, False, True, True, False, True, True, False]
    cfg = compose(TINY + ["config.OPTIMIZER.num_epochs=4", "config.TEST_EVERY_NUM_EPOCH=3"])
    assert [p["train"] for p in build_phases(cfg)] == [True, False, True, True, True, False]
    cfg = compose(TINY + ["config.TEST_MODEL=false"])
    assert [p["train"] for p in build_phases(cfg)] == [True, True]
    cfg = compose(TINY + ["config.TEST_ONLY=true"])
    assert [p["train"] for p in build_phases(cfg)] == [False]


def _phase_walk(task):
    """(phase_idx, train, train_phase_idx) of each phase the task still enters, without running them."""
    seen = []
    while not task.done_training():
        if task._resume_in_phase:
            task._resume_in_phase = False
        else:
            task.phase_idx += 1
            task.train = task.phases[task.phase_idx]["train"]
            task.train_phase_idx += task.train
        seen.append((task.phase_idx, task.train, task.train_phase_idx))
        task.phase_complete = True
    return seen


@pytest.mark.parametrize("first, second, expect", [
    # checkpoint after train phase 1 of [T E T E T E]; resumed without test phases: [T T T]
    (["config.OPTIMIZER.num_epochs=3"], ["config.OPTIMIZER.num_epochs=3", "config.TEST_MODEL=false"],
     [(2, True, 2)]),
    # checkpoint after train phase 1 of [T T T]; resumed with tests: [T E T E T E]
    (["config.OPTIMIZER.num_epochs=3", "config.TEST_MODEL=false"], ["config.OPTIMIZER.num_epochs=3"],
     [(3, False, 1), (4, True, 2), (5, False, 2)]),
    # same, resumed with TEST_EVERY_NUM_EPOCH=2: [T E T T E]; no test after train phase 1 there
    (["config.OPTIMIZER.num_epochs=3", "config.TEST_MODEL=false"],
     ["config.OPTIMIZER.num_epochs=3", "config.TEST_EVERY_NUM_EPOCH=2"], [(3, True, 2), (4, False, 2)]),
])
def test_resume_finds_the_checkpoints_phase_when_the_phase_list_changed(tmp_path, first, second, expect):
    """A checkpoint's phase_idx counts the phases of the run that wrote it; a resumed run whose
    phase list differs goes on after the same train phase, never skipping or repeating an epoch."""
    task = tiny_task(tmp_path / "a", *first)
    while task.train_phase_idx < 1 or not task.train:  # up to the end of train phase 1
        run_phase(task)
    state = task.get_classy_state()
    assert state["train"] and state["train_phase_idx"] == 1 and state["phase_complete"]
    resumed = tiny_task(tmp_path / "b", *second)
    resumed.set_classy_state(state)
    assert _phase_walk(resumed) == expect


def test_resume_drops_an_interrupted_test_phase_the_new_config_lacks(tmp_path, caplog):
    task = tiny_task(tmp_path / "a", "config.OPTIMIZER.num_epochs=2")
    run_phase(task)  # train phase 0
    task.advance_phase()  # into the test phase after it, interrupted after one batch
    task.train_step_fn(task)
    state = task.get_classy_state()
    assert not state["train"] and not state["phase_complete"] and state["phase_idx"] == 1
    resumed = tiny_task(tmp_path / "b", "config.OPTIMIZER.num_epochs=2", "config.TEST_MODEL=false")
    with caplog.at_level("WARNING"):
        resumed.set_classy_state(state)
    assert "does not have" in caplog.text
    assert _phase_walk(resumed) == [(1, True, 1)]  # train phase 1 next: phase 0 is not trained again


def test_train_phase_updates_and_test_phase_does_not(tmp_path):
    task = tiny_task(tmp_path)
    before = {k: v.clone() for k, v in task.base_model.state_dict().items()}
    run_phase(task)
    assert task.iteration == 4 and task.train_phase_idx == 0
    assert not torch.equal(before["heads.0.clf.0.weight"], task.base_model.state_dict()["heads.0.clf.0.weight"])
    after_train = {k: v.clone() for k, v in task.base_model.state_dict().items()}
    run_phase(task)  # the test phase
    assert not task.train and task.iteration == 4 and task.local_iteration_num == 2
    assert all(torch.equal(after_train[k], v) for k, v in task.base_model.state_dict().items())
    assert task.meters[0].value["top_1"]["0"] >= 0


def test_non_trainable_params_keep_their_values_and_a_wrong_name_is_one_line(tmp_path):
    """MODEL.NON_TRAINABLE_PARAMS (VISSL: exact parameter names; here also module names) were
    accepted but not acted on: the whole model trained."""
    task = tiny_task(tmp_path, "config.MODEL.NON_TRAINABLE_PARAMS=[trunk,heads.0.clf.0.bias]",
                     "config.OPTIMIZER.weight_decay=0.01")
    before = {k: v.clone() for k, v in task.base_model.named_parameters()}
    optimized = {id(p) for g in task.optimizer.optimizer.param_groups for p in g["params"]}
    run_phase(task)
    moved = sorted(k for k, v in task.base_model.named_parameters() if not torch.equal(before[k], v))
    assert moved == ["heads.0.clf.0.weight"]
    assert optimized == {id(task.base_model.heads[0].clf[0].weight)}
    r = run_tool(TINY + [f"config.CHECKPOINT.DIR={tmp_path / 'bad'}", "config.MODEL.NON_TRAINABLE_PARAMS=[trunk.conv1]"])
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "config.MODEL.NON_TRAINABLE_PARAMS[0]: 'trunk.conv1' names no parameter or module" in err, err


def test_a_temp_frozen_name_that_names_nothing_is_refused_before_launch(tmp_path):
    """The name is checked on the model built before launch: the run's folder is not made (it
    was refused by each rank's hook, after the folder held a log and the config)."""
    folder = tmp_path / "bad"
    r = run_tool(TINY + [f"config.CHECKPOINT.DIR={folder}",
                         "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[[heads.0.clf.0.weight,2],[heads.0.clf.9.weight,2]]"])
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP[1]: 'heads.0.clf.9.weight' names no parameter or module" in err, err
    assert not folder.exists() or not any(folder.iterdir()), sorted(p.name for p in folder.iterdir())


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path):
    a = tiny_task(tmp_path / "a", "config.TRAINER.GRAD_ACCUMULATION_STEPS=2", "config.OPTIMIZER.momentum=0.0",
                  "config.OPTIMIZER.weight_decay=0.0")
    b = tiny_task(tmp_path / "b", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16", "config.OPTIMIZER.momentum=0.0",
                  "config.OPTIMIZER.weight_decay=0.0")
    b.base_model.load_state_dict(a.base_model.state_dict())
    run_phase(a)
    run_phase(b)
    for (k, x), y in zip(a.base_model.state_dict().items(), b.base_model.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-5), k


def test_gradient_accumulation_reads_the_step_schedule_as_a_bigger_batch_does(tmp_path):
    """2 accumulated batches of 8 take the lr one batch of 16 takes at each update (that of the
    update's first batch): the schedule starts at its start_value, and the weights are the same."""
    sched = ["config.OPTIMIZER.param_schedulers.lr.name=linear", "config.OPTIMIZER.param_schedulers.lr.start_value=0.4",
             "config.OPTIMIZER.param_schedulers.lr.end_value=0.0", "config.OPTIMIZER.param_schedulers.lr.update_interval=step",
             "config.OPTIMIZER.momentum=0.0", "config.OPTIMIZER.weight_decay=0.0"]
    a = tiny_task(tmp_path / "a", "config.TRAINER.GRAD_ACCUMULATION_STEPS=2", *sched)
    b = tiny_task(tmp_path / "b", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16", *sched)
    b.base_model.load_state_dict(a.base_model.state_dict())
    lrs = {"a": [], "b": []}
    for name, task in (("a", a), ("b", b)):
        step = task.optimizer.step
        task.optimizer.step = lambda *args, _step=step, _lrs=lrs[name], _t=task: (_lrs.append(_t.optimizer.lr), _step())[1]
        run_phase(task)
    assert lrs["a"] == lrs["b"] and lrs["a"][0] == 0.4, lrs
    for (k, x), y in zip(a.base_model.state_dict().items(), b.base_model.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-5), k


@pytest.mark.parametrize("accum", [3, 8])
def test_gradient_accumulation_steps_at_the_end_of_each_train_phase(tmp_path, accum):
    """4 batches per phase: with 8 accumulation steps the run never updated the weights; with 3
    the last batch's gradients were left for the next epoch's first update (and lost on resume)."""
    task = tiny_task(tmp_path, f"config.TRAINER.GRAD_ACCUMULATION_STEPS={accum}")
    assert task.iters_per_epoch == 4
    before = [p.detach().clone() for p in task.base_model.parameters()]
    run_phase(task)
    assert any(not torch.equal(p, b) for p, b in zip(task.base_model.parameters(), before)), "no update"
    assert all(p.grad is None for p in task.base_model.parameters()), "gradients left for the next phase"


def test_gradient_clipping_bounds_the_update(tmp_path):
    task = tiny_task(tmp_path, "config.MODEL.GRAD_CLIP.USE_GRAD_CLIP=true", "config.MODEL.GRAD_CLIP.MAX_NORM=0.001",
                     "config.OPTIMIZER.momentum=0.0", "config.OPTIMIZER.weight_decay=0.0")
    before = [p.detach().clone() for p in task.base_model.parameters()]
    task.advance_phase()
    task.train_step_fn(task)
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(task.base_model.parameters(), before)])
    assert delta.norm().item() <= 0.1 * 0.001 * 1.0001  # lr x max_norm


@pytest.mark.parametrize("native", [True, False])
def test_amp_bfloat16_on_cpu_trains(tmp_path, caplog, monkeypatch, native):
    from ssl_engine.tasks import self_supervision_task as sst

    monkeypatch.setattr(sst, "cpu_has_native", lambda name: native)
    with caplog.at_level(logging.INFO, logger="ssl_engine.tasks.self_supervision_task"):
        task = tiny_task(tmp_path, "config.MODEL.AMP_PARAMS.USE_AMP=true")
    assert task.amp_dtype == torch.bfloat16 and task.grad_scaler is None
    assert "torch.autocast to bfloat16 on cpu" in caplog.text  # the numerics change is announced
    # a GPU yaml on a CPU without native bfloat16: emulated, many times slower; said as a warning with the fix
    slow = [r for r in caplog.records if r.levelno == logging.WARNING and "without native bfloat16" in r.getMessage()]
    assert len(slow) == (0 if native else 1)
    assert native or "config.MODEL.AMP_PARAMS.USE_AMP=false" in slow[0].getMessage()
    task.advance_phase()
    task.train_step_fn(task)
    assert task.last_model_output[0].dtype == torch.bfloat16
    assert torch.isfinite(task.last_loss)


def test_non_finite_loss_names_iteration_and_phase(tmp_path):
    task = tiny_task(tmp_path, "config.OPTIMIZER.param_schedulers.lr.value=1e30")
    task.advance_phase()
    with pytest.raises(NonFiniteLossError, match=r"iteration \d+ \(phase 0, train"):
        for _ in range(4):
            task.train_step_fn(task)


def test_a_label_beyond_the_heads_classes_is_a_user_error_naming_the_head_and_the_label(tmp_path):
    """On the CPU cross-entropy raises "IndexError: Target 7 is out of bounds"; the step turns it
    into a UserError naming the head's key, its class count and the label (the run's fallback for
    heads the pre-launch check cannot size)."""
    task = tiny_task(tmp_path, "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,3]}]]")
    task.advance_phase()
    with pytest.raises(UserError, match=r"MODEL\.HEAD\.PARAMS\[0\] \(mlp\), scored by config\.LOSS\.name="
                                        r"cross_entropy_multiple_output_single_target, outputs 3 classes .*"
                                        r"config\.DATA\.TRAIN has label [3-9] .*at least \d+ classes"):
        task.train_step_fn(task)


def test_a_meter_given_a_label_beyond_the_heads_classes_names_the_meter(tmp_path):
    """classy's precision@k meter asserts on a label >= the class count; the step names the meter."""
    from classy_vision.losses import ClassyLoss

    from ssl_engine.registry import LOSSES

    if "test_label_free_loss" not in LOSSES:
        @LOSSES.register("test_label_free_loss")
        class LabelFreeLoss(ClassyLoss):  # scores no labels: the meter is the first to read them
            @classmethod
            def from_config(cls, cfg):
                return cls()

            def forward(self, output, target):
                return output[0].float().pow(2).mean()

    task = tiny_task(tmp_path, "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,3]}]]", "config.LOSS.name=test_label_free_loss",
                     "config.METERS.names=[precision_at_k_list_meter]")
    task.advance_phase()
    with pytest.raises(UserError, match=r"MODEL\.HEAD\.PARAMS\[0\] \(mlp\), scored by the meter "
                                        r"config\.METERS\.precision_at_k_list_meter, outputs 3 classes"):
        task.train_step_fn(task)


def test_a_loss_that_does_not_score_class_indices_keeps_its_own_error(tmp_path):
    """Only losses and meters with class_index_targets are explained: another loss's IndexError stands."""
    from classy_vision.losses import ClassyLoss

    from ssl_engine.registry import LOSSES

    if "test_indexing_loss" not in LOSSES:
        @LOSSES.register("test_indexing_loss")
        class IndexingLoss(ClassyLoss):
            @classmethod
            def from_config(cls, cfg):
                return cls()

            def forward(self, output, target):
                return torch.nn.functional.cross_entropy(output[0], target)

    task = tiny_task(tmp_path, "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,3]}]]", "config.LOSS.name=test_indexing_loss")
    task.advance_phase()
    with pytest.raises(IndexError, match="out of bounds"):
        task.train_step_fn(task)


def test_registry_lists_known_names_on_unknown():
    reg = Registry("widget", "config.WIDGET")

    @reg.register("round")
    class Round:
        pass

    @reg.register()
    def square():
        return 1

    assert reg.get("round") is Round and reg.get("square") is square and "round" in reg
    with pytest.raises(UserError, match=r"unknown widget 'rond' \(config key config.WIDGET\).*did you mean 'round'.*known: round, square"):
        reg.get("rond")
    with pytest.raises(ValueError):
        reg.register("round")(square)


def test_registry_names_a_vissl_part_it_lacks_as_such_and_lets_a_user_register_it():
    """A name VISSL registers that the engine lacks is not answered with the closest name it has
    (a VISSL deepclusterv2_loss is no swav_loss), and a user module may still register it."""
    reg = Registry("loss", "config.LOSS.name", "LOSSES", vissl_names=("deepclusterv2_loss",))
    reg.register("swav_loss")(object)
    with pytest.raises(UserError) as e:
        reg.get("deepclusterv2_loss")
    assert "one of VISSL's that ssl_engine does not implement; implemented: swav_loss" in str(e.value)
    assert "@LOSSES.register('deepclusterv2_loss')" in str(e.value) and "did you mean" not in str(e.value)

    @reg.register("deepclusterv2_loss")
    class Mine:
        pass

    assert reg.get("deepclusterv2_loss") is Mine


@pytest.mark.parametrize("override, expected", [
    ("config.MODEL.HEAD.PARAMS=[[eval_mlp_fsdp,{in_channels:16,dims:[16,10]}]]",
     "head 'eval_mlp_fsdp' (config key config.MODEL.HEAD.PARAMS[0][0]) is VISSL's FSDP (fully sharded data parallel) "
     "variant of 'eval_mlp'; ssl_engine shards no model (it trains with DistributedDataParallel): name 'eval_mlp' "
     "instead, which takes the same settings"),
    ("config.TRAINER.TASK_NAME=self_supervision_fsdp_task", "name 'self_supervision_task' instead"),
    ("config.MODEL.TRUNK.NAME=regnet_fsdp", "variant of 'regnet'; ssl_engine shards no model"),
    ("config.MODEL.HEAD.PARAMS=[[dino_head_fsdp,{in_dim:16}]]",
     "variant of 'dino_head'; ssl_engine shards no model (it trains with DistributedDataParallel), and 'dino_head' "
     "is one of VISSL's that ssl_engine does not implement; implemented: eval_mlp, mlp, swav_head"),
])
def test_a_vissl_fsdp_part_is_named_with_the_part_it_shards(override, expected):
    """VISSL's FSDP configs name the sharded variants of its parts (eval_mlp_fsdp, regnet_fsdp,
    self_supervision_fsdp_task): the line names the plain part to use, not a "did you mean"."""
    from ssl_engine.config import compose
    from ssl_engine.config.validate import check_registered_names
    from ssl_engine.engines.run import load_builtin_parts

    load_builtin_parts()
    with pytest.raises(UserError) as e:
        check_registered_names(compose(["config=quick/supervised_digits", override]))
    assert expected in str(e.value) and "did you mean" not in str(e.value)


def test_several_unregistered_parts_name_the_fsdp_variants_among_them():
    from ssl_engine.config import compose
    from ssl_engine.config.validate import check_registered_names
    from ssl_engine.engines.run import load_builtin_parts

    load_builtin_parts()
    with pytest.raises(UserError) as e:
        check_registered_names(compose(["config=quick/supervised_digits", "config.TRAINER.TASK_NAME=self_supervision_fsdp_task",
                                        "config.LOSS.name=dino_loss"]))
    assert ("task 'self_supervision_fsdp_task' (config.TRAINER.TASK_NAME; VISSL's FSDP variant of 'self_supervision_task'), "
            "loss 'dino_loss' (config.LOSS.name; one of VISSL's that ssl_engine does not implement)") in str(e.value)


def test_extraction_asks_a_model_only_prepare_only_of_tasks_that_take_it():
    """A user task whose prepare(self, local_rank=0) predates the data keyword still builds
    (as it always did) instead of failing with a TypeError."""
    from ssl_engine.tasks.self_supervision_task import SelfSupervisionTask
    from ssl_engine.trainer import model_only

    class OldUserTask(SelfSupervisionTask):
        def prepare(self, local_rank=0):  # noqa: D102
            return super().prepare(local_rank)

    class ForwardingUserTask(SelfSupervisionTask):
        def prepare(self, local_rank=0, **kwargs):  # noqa: D102
            return super().prepare(local_rank, **kwargs)

    assert model_only(OldUserTask.__new__(OldUserTask)) == {}
    assert model_only(ForwardingUserTask.__new__(ForwardingUserTask)) == {"data": False}
    assert model_only(SelfSupervisionTask.__new__(SelfSupervisionTask)) == {"data": False}


ROTNET = [
    "config=quick/supervised_digits", "config.OPTIMIZER.num_epochs=1", "config.DATA.NUM_DATALOADER_WORKERS=0",
    "config.DATA.TRAIN.DATA_LIMIT=64", "config.DATA.TEST.DATA_LIMIT=32",
    "config.DATA.TRAIN.TRANSFORMS=[{name: ImgRotatePil},{name: ToTensor}]",
    "config.DATA.TEST.TRANSFORMS=[{name: ImgRotatePil},{name: ToTensor}]",
    "config.METERS.accuracy_list_meter.topk_values=[1]",
    "config.DATA.TRAIN.LABEL_SOURCES=[]", "config.DATA.TEST.LABEL_SOURCES=[]",  # as VISSL's rotnet yaml: none
]


def test_rotnet_trains_on_the_rotation_labels_img_rotate_pil_sets(tmp_path: Path) -> None:
    """VISSL's RotNet: ImgRotatePil's rotation index is the label, so the loss and meter have
    labels without LABEL_SOURCES, a 4-way head fits, and a 3-way head is refused before launch,
    naming the transform."""
    r = run_tool(ROTNET + ["config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,4]}]]", f"config.CHECKPOINT.DIR={tmp_path / 'ok'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    test = [json.loads(line) for line in (tmp_path / "ok" / "metrics.json").read_text().splitlines()][-1]
    assert 0.0 <= test["test_accuracy_list_meter"]["top_1"]["0"] <= 100.0
    r = run_tool(ROTNET + ["config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,3]}]]", f"config.CHECKPOINT.DIR={tmp_path / 'bad'}"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "has label 3 (set by ImgRotatePil in config.DATA.TRAIN.TRANSFORMS); make that head output at least 4 classes "
        "(for mlp/eval_mlp the last entry of its dims)")


def test_without_the_training_meter_train_phases_report_no_meter_values(tmp_path: Path) -> None:
    """METERS.enable_training_meter false leaves the meters out of train phases (as VISSL's metrics
    file and log do): no train_<meter> value in metrics.json, where 0% would be a false result.
    Test phases report theirs."""
    r = run_tool(["config=quick/supervised_digits", f"config.CHECKPOINT.DIR={tmp_path}", "config.OPTIMIZER.num_epochs=1",
                  "config.DATA.TRAIN.DATA_LIMIT=32", "config.DATA.TEST.DATA_LIMIT=16", "config.DATA.NUM_DATALOADER_WORKERS=0",
                  "config.METERS.enable_training_meter=false"])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.json").read_text().splitlines()]
    train = [x for x in lines if "train_loss" in x]
    test = [x for x in lines if "test_loss" in x]
    assert len(train) == 1 and len(test) == 1, lines
    assert not [k for k in train[0] if k.startswith("train_") and k != "train_loss" and k != "train_phase_idx"], train
    assert "test_accuracy_list_meter" in test[0], test
    assert "train phase 0 done: loss" in r.stdout and "accuracy_list_meter" not in r.stdout.split("train phase 0 done")[1].splitlines()[0]
