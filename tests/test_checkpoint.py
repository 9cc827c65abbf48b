"""Checkpoint files: atomic writes, newest-good lookup, safe loading, weight initialisation."""

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch
import torchvision

from ssl_engine import checkpoint as ck
from ssl_engine.config import compose
from ssl_engine.errors import CheckpointError, UserError


def engine_ckpt(iteration):
    return {"phase_idx": 0, "train_phase_idx": 0, "iteration": iteration, "iteration_num": iteration,
            "type": "iteration", "classy_state_dict": {"phase_idx": 0, "base_model": {"w": torch.full((3,), float(iteration))}}}


def test_save_points_and_prunes(tmp_path):
    for i in (2, 4, 6):
        ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(i), engine_ckpt(i), keep_last=2)
    ck.save_checkpoint(tmp_path, ck.final_checkpoint_name(0), engine_ckpt(7), keep_last=2)
    ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(8), engine_ckpt(8), keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint.torch", "model_final_checkpoint_phase0.torch", "model_iteration6.torch",
                     "model_iteration8.torch"]
    assert os.readlink(tmp_path / "checkpoint.torch") == "model_iteration8.torch"
    path, data = ck.newest_good_checkpoint(tmp_path)
    assert path.name == "model_iteration8.torch" and data["iteration"] == 8


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(2), engine_ckpt(2))

    def full_disk(obj, f):
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=f"in {tmp_path}: the disk is full"):
        ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(4), engine_ckpt(4))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.torch", "model_iteration2.torch"]
    assert ck.load_checkpoint(tmp_path / "checkpoint.torch")["iteration"] == 2


def test_a_folder_deleted_between_the_write_and_the_pointer_swap_is_named_as_gone(tmp_path, monkeypatch):
    """The folder can vanish after the checkpoint file is renamed into place and before the
    pointer is swapped (a background write races the deletion): the error is the same
    'folder is gone' one as for a write that failed, not a bare 'No such file or directory'."""
    import shutil

    folder = tmp_path / "run"
    folder.mkdir()
    real_write = ck.atomic_write

    def write_then_delete_folder(path, write, mode="wb"):
        real_write(path, write, mode)
        shutil.rmtree(folder)

    monkeypatch.setattr(ck, "atomic_write", write_then_delete_folder)
    with pytest.raises(CheckpointError) as e:
        ck.save_checkpoint(folder, ck.iteration_checkpoint_name(2), engine_ckpt(2))
    assert f"its folder {folder} is gone (deleted or moved while the run was using it" in str(e.value)
    assert not folder.exists()


@pytest.mark.parametrize("dies_at", ["marker", "mkdir", "first_move"])
def test_a_set_aside_killed_at_any_step_is_finished_by_the_next_run(tmp_path, monkeypatch, dies_at):
    """Setting an earlier run aside writes its marker, makes previous_run.N and moves the files
    one by one: a kill at any step leaves a marker that the next run's finish_set_aside completes,
    never a previous_run.N that nothing names (empty, beside the earlier run's files)."""
    for i in (2, 4):
        ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(i), engine_ckpt(i))
    (tmp_path / "metrics.json").write_text('{"iteration": 4}\n')
    before = sorted(p.name for p in tmp_path.iterdir())

    class Killed(BaseException):
        pass

    real_write, real_mkdir, real_replace = ck.atomic_write_text, Path.mkdir, os.replace

    def write(path, text):
        real_write(path, text)
        if dies_at == "marker":
            raise Killed

    def mkdir(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if dies_at == "mkdir" and self.name.startswith("previous_run."):
            raise Killed

    def replace(src, dst):
        real_replace(src, dst)
        if dies_at == "first_move":
            raise Killed

    monkeypatch.setattr(ck, "atomic_write_text", write)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(Killed):
        ck.set_aside_previous_run(tmp_path)
    monkeypatch.undo()
    previous = tmp_path / "previous_run.1"
    # the marker names the folder from the first step on (an unnamed empty previous_run.1 would stay forever)
    assert (tmp_path / ck.SET_ASIDE_MARKER).read_text() == "previous_run.1\n"
    assert ck.finish_set_aside(tmp_path) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous_run.1"]
    assert sorted(p.name for p in previous.iterdir()) == before
    assert ck.newest_good_checkpoint(tmp_path) is None


def test_a_checkpoint_whose_bytes_changed_is_skipped_on_resume(tmp_path, caplog):
    """Same size, zip directory intact, tensor bytes changed (a damaged disk or copy): it loads,
    but the zip's CRC-32 of the record no longer matches; the resume takes the previous one."""
    for i in (2, 4):
        state = engine_ckpt(i)
        state["classy_state_dict"]["base_model"]["w"] = torch.full((1000,), float(i))
        ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(i), state)
    newest = tmp_path / "model_iteration4.torch"
    raw = bytearray(newest.read_bytes())
    at = raw.find(torch.full((100,), 4.0).numpy().tobytes())
    assert at > 0
    raw[at:at + 4] = torch.tensor([5.0]).numpy().tobytes()
    newest.write_bytes(bytes(raw))
    assert ck.load_checkpoint(newest)["classy_state_dict"]["base_model"]["w"][0] == 5.0  # torch.load does not notice
    path, data = ck.newest_good_checkpoint(tmp_path)
    assert path.name == "model_iteration2.torch" and data["iteration"] == 2
    assert "skipping checkpoint model_iteration4.torch: it is corrupt: the stored checksum of its record" in caplog.text
    assert ck.damaged_record(tmp_path / "model_iteration2.torch") is None


def test_truncated_and_foreign_files_are_skipped(tmp_path, caplog):
    ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(2), engine_ckpt(2))
    ck.save_checkpoint(tmp_path, ck.iteration_checkpoint_name(4), engine_ckpt(4))
    newest = tmp_path / "model_iteration4.torch"
    newest.write_bytes(newest.read_bytes()[:200])
    path, data = ck.newest_good_checkpoint(tmp_path)
    assert path.name == "model_iteration2.torch"
    assert "skipping checkpoint model_iteration4.torch" in caplog.text
    with pytest.raises(CheckpointError, match="is truncated or corrupt: its zip archive cannot be read"):
        ck.load_checkpoint(newest)


@pytest.mark.parametrize("content, says", [
    (b"", "is empty"),
    (b"hello\n", "is not a file written by torch.save (it starts with b'hello"),
    (b"\x80\x02}q\x00", "is truncated or corrupt: its pickle cannot be read"),
])
def test_an_unreadable_file_is_named_with_what_it_is(tmp_path, content, says):
    """torch's own errors say "KeyError: '101'" for a text file: the message says what the file is."""
    bad = tmp_path / "weights.torch"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        ck.load_checkpoint(bad)
    assert says in str(err.value) and str(bad) in str(err.value)


class Payload:
    """Unpickling this creates a marker file: a checkpoint loader must never do it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_is_refused_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "model_iteration9.torch"
    torch.save({"phase_idx": 0, "classy_state_dict": {"x": Payload(str(marker))}}, str(evil))
    with pytest.raises(CheckpointError, match="refused to load"):
        ck.load_checkpoint(evil)
    assert not marker.exists()
    assert ck.newest_good_checkpoint(tmp_path) is None
    assert not marker.exists()
    with open(tmp_path / "plain.pkl", "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(CheckpointError):
        ck.load_checkpoint(tmp_path / "plain.pkl")
    assert not marker.exists()


def weights_cfg(path, eval_settings=(), **kw):
    """config.MODEL with WEIGHTS_INIT.PARAMS_FILE=path, WEIGHTS_INIT keys ``kw`` and FEATURE_EVAL_SETTINGS overrides."""
    cfg = compose(["config.MACHINE.DEVICE=cpu"] + [f"config.MODEL.FEATURE_EVAL_SETTINGS.{s}" for s in eval_settings]).MODEL
    cfg.WEIGHTS_INIT.PARAMS_FILE = str(path)
    for k, v in kw.items():
        cfg.WEIGHTS_INIT[k] = v
    return cfg


def resnet18_model():
    from ssl_engine.models import build_model

    cfg = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,10]}]]"])
    return build_model(cfg.MODEL, cfg.OPTIMIZER)


def test_init_from_torchvision_state_dict_with_prefix_and_skip(tmp_path):
    torch.manual_seed(1)
    tv = torchvision.models.resnet18()
    torch.save(tv.state_dict(), str(tmp_path / "tv.pth"))
    model = resnet18_model()
    head_before = model.heads[0].clf[0].weight.clone()
    report = ck.init_model_from_weights(
        model, weights_cfg(tmp_path / "tv.pth", STATE_DICT_KEY_NAME="", APPEND_PREFIX="trunk._feature_blocks.",
                           SKIP_LAYERS=["num_batches_tracked", "layer4"])
    )
    own = model.state_dict()
    assert torch.equal(own["trunk._feature_blocks.conv1.weight"], tv.state_dict()["conv1.weight"])
    assert torch.equal(own["trunk._feature_blocks.layer3.1.bn2.running_var"], tv.state_dict()["layer3.1.bn2.running_var"])
    assert not torch.equal(own["trunk._feature_blocks.layer4.0.conv1.weight"], tv.state_dict()["layer4.0.conv1.weight"])
    assert torch.equal(model.heads[0].clf[0].weight, head_before)
    assert "trunk._feature_blocks.fc.weight" in report["unexpected"]
    assert any(k.startswith("heads.") for k in report["missing"])


def test_init_from_weights_with_nan_or_inf_is_refused_naming_the_file(tmp_path):
    """A file of a run that diverged (NaN weights) was loaded as good: extraction then wrote NaN
    features with a 'complete' status. The weights the model would take are checked."""
    tv = torchvision.models.resnet18()
    state = tv.state_dict()
    state["layer1.0.conv1.weight"][0, 0, 0, 0] = float("nan")
    state["fc.weight"][:] = float("inf")  # not taken by the model (unexpected key): not counted
    state["layer2.0.bn1.running_var"][:3] = float("inf")
    torch.save(state, str(tmp_path / "diverged.pth"))
    model = resnet18_model()
    before = model.state_dict()["trunk._feature_blocks.layer1.0.conv1.weight"].clone()
    with pytest.raises(UserError) as e:
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "diverged.pth", STATE_DICT_KEY_NAME="",
                                                      APPEND_PREFIX="trunk._feature_blocks."))
    assert str(e.value).startswith(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {tmp_path / 'diverged.pth'}: 4 of its "
                                   f"weights are NaN or infinite, in 2 tensor(s) ("), str(e.value)
    assert torch.equal(model.state_dict()["trunk._feature_blocks.layer1.0.conv1.weight"], before)  # nothing loaded


@pytest.mark.parametrize("value,says", [
    ([1.0, 2.0], "holds a list, not a tensor"),
    ("conv", "holds a str, not a tensor"),
    (torch.zeros(64, 3, 7, 7, dtype=torch.int64), "holds torch.int64 values, the model's weight is torch.float32"),
    (torch.zeros(64, 3, 7, 7, dtype=torch.complex64), "holds torch.complex64 values, the model's weight is torch.float32"),
])
def test_init_from_a_file_whose_weight_entry_is_not_a_float_tensor_is_refused(tmp_path, value, says):
    """An entry under a weight's name holding no tensor was left out as 'missing' (the weight kept
    its random init, a warning, and extraction went on); integer or complex values were copied into
    the float weight, cut to integers or real parts. Both are one error naming the entry; nothing is
    loaded. A float16 file loads as before."""
    state = torchvision.models.resnet18().state_dict()
    state["conv1.weight"] = value
    torch.save(state, str(tmp_path / "odd.pth"))
    model = resnet18_model()
    before = model.state_dict()["trunk._feature_blocks.layer1.0.conv1.weight"].clone()
    cfg = weights_cfg(tmp_path / "odd.pth", STATE_DICT_KEY_NAME="", APPEND_PREFIX="trunk._feature_blocks.")
    with pytest.raises(UserError) as e:
        ck.init_model_from_weights(model, cfg)
    assert str(e.value).startswith(
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {tmp_path / 'odd.pth'}: 1 of its entries named as the model's weights "
        f"are not weights (trunk._feature_blocks.conv1.weight {says}); "), str(e.value)
    assert torch.equal(model.state_dict()["trunk._feature_blocks.layer1.0.conv1.weight"], before)  # nothing loaded
    state["conv1.weight"] = torch.ones(64, 3, 7, 7, dtype=torch.float16)
    torch.save(state, str(tmp_path / "odd.pth"))
    ck.init_model_from_weights(model, cfg)
    assert torch.equal(model.state_dict()["trunk._feature_blocks.conv1.weight"], torch.ones(64, 3, 7, 7))


def test_init_from_vissl_layout_and_removed_prefix(tmp_path):
    src = resnet18_model()
    state = {"trunk": {k[len("trunk."):]: v for k, v in src.state_dict().items() if k.startswith("trunk.")},
             "heads": {k[len("heads."):]: v for k, v in src.state_dict().items() if k.startswith("heads.")}}
    torch.save({"classy_state_dict": {"base_model": {"model": state, "meta": {}}}}, str(tmp_path / "vissl.torch"))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "vissl.torch"))
    assert not report["missing"] and not report["unexpected"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values())
               if a.dtype.is_floating_point)
    # a DDP-style "module." prefix is removed by REMOVE_PREFIX
    torch.save({"model_state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}}, str(tmp_path / "ddp.pt"))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "ddp.pt", STATE_DICT_KEY_NAME="model_state_dict",
                                                           REMOVE_PREFIX="module."))
    assert not report["missing"]


def test_a_state_dict_key_name_the_file_lacks_is_refused_naming_its_keys(tmp_path):
    """VISSL asserts on an unknown STATE_DICT_KEY_NAME. Was: the usual layouts were tried instead,
    so a misspelt model_ema loaded the file's model weights without a word."""
    src = resnet18_model()
    weights = src.state_dict()
    torch.save({"model": weights, "model_ema": {k: v * 0.5 for k, v in weights.items()}}, str(tmp_path / "ema.torch"))
    with pytest.raises(CheckpointError, match=r"STATE_DICT_KEY_NAME='model_emaa' is not a key of .*ema\.torch "
                                              r"\(closest: model_ema, model\); its top-level keys: 'model', 'model_ema'"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "ema.torch", STATE_DICT_KEY_NAME="model_emaa"))
    model = resnet18_model()
    ck.init_model_from_weights(model, weights_cfg(tmp_path / "ema.torch", STATE_DICT_KEY_NAME="model_ema"))
    name, value = next((k, v) for k, v in model.state_dict().items() if v.dtype.is_floating_point and v.abs().sum() > 0)
    assert torch.equal(value, weights[name] * 0.5)
    # the default key still falls back to the usual layouts (a torchvision or plain file has no classy_state_dict)
    ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "ema.torch"))
    torch.save({}, str(tmp_path / "empty.torch"))
    with pytest.raises(CheckpointError, match="it holds an empty mapping"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "empty.torch"))


def test_an_evaluation_loads_the_files_heads_only_with_eval_trunk_and_head(tmp_path, caplog):
    """VISSL's rule: with FEATURE_EVAL_SETTINGS.EVAL_MODE_ON the heads of PARAMS_FILE are left out
    (a linear probe starts from new heads even when the shapes fit) unless EVAL_TRUNK_AND_HEAD."""
    import logging

    torch.manual_seed(3)
    src = resnet18_model()
    torch.save({"classy_state_dict": {"base_model": {"model": {
        "trunk": {k[6:]: v for k, v in src.state_dict().items() if k.startswith("trunk.")},
        "heads": {k[6:]: v for k, v in src.state_dict().items() if k.startswith("heads.")}}}}}, str(tmp_path / "w.torch"))
    head = "heads.0.clf.0.weight"
    for settings, heads_loaded in ((("EVAL_MODE_ON=true",), False),
                                   (("EVAL_MODE_ON=true", "EVAL_TRUNK_AND_HEAD=true"), True),
                                   ((), True)):  # fine-tuning: the whole model
        torch.manual_seed(4)
        model = resnet18_model()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ssl_engine.checkpoint"):
            report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "w.torch", settings))
        own = model.state_dict()
        assert torch.equal(own["trunk._feature_blocks.conv1.weight"], src.state_dict()["trunk._feature_blocks.conv1.weight"])
        assert torch.equal(own[head], src.state_dict()[head]) is heads_loaded, settings
        assert (head in report["loaded"]) is heads_loaded
        assert ("EVAL_TRUNK_AND_HEAD=true" in caplog.text) is not heads_loaded
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_init_warns_when_trunk_weights_keep_their_random_init(tmp_path, caplog):
    """New heads on a pretrained trunk are the usual case (info); a trunk weight not loaded, or
    skipped for its shape, is a warning that names it."""
    import logging

    src = resnet18_model()
    trunk = {k: v for k, v in src.state_dict().items() if k.startswith("trunk.")}
    torch.save(trunk, str(tmp_path / "trunk.torch"))
    with caplog.at_level(logging.INFO, logger="ssl_engine.checkpoint"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "trunk.torch", STATE_DICT_KEY_NAME=""))
    assert "initialised weights" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    widened = dict(trunk)
    name = "trunk._feature_blocks.conv1.weight"
    widened[name] = torch.zeros(64, 4, 7, 7)
    torch.save(widened, str(tmp_path / "widened.torch"))
    # a trunk weight of another shape stops the run (as in VISSL), unless SKIP_LAYERS names it
    with pytest.raises(UserError, match=r"1 of its weights are named as the model's but have another shape \(e\.g\. "
                                        r"trunk\._feature_blocks\.conv1\.weight \(64, 4, 7, 7\) vs \(64, 3, 7, 7\).*"
                                        r"SKIP_LAYERS"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "widened.torch", STATE_DICT_KEY_NAME=""))
    with caplog.at_level(logging.INFO, logger="ssl_engine.checkpoint"):
        report = ck.init_model_from_weights(resnet18_model(), weights_cfg(
            tmp_path / "widened.torch", STATE_DICT_KEY_NAME="", SKIP_LAYERS=["num_batches_tracked", "_feature_blocks.conv1."]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert report["skipped"] and not report["shape_mismatch"]
    assert any(name in w for w in warnings), warnings  # named: it keeps its random init
    assert name not in report["missing"]  # counted once, as skipped
    # SKIP_LAYERS that leaves trunk weights at their random init is counted and warned about (was: "2 loaded,
    # 0 missing" at INFO, with the trunk random); its default, BatchNorm's counters, is not
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ssl_engine.checkpoint"):
        report = ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "trunk.torch", STATE_DICT_KEY_NAME="",
                                                                           SKIP_LAYERS=["num_batches_tracked", "layer4"]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    n_skipped = len([k for k in trunk if "layer4" in k or "num_batches_tracked" in k])
    assert len(report["skipped"]) == n_skipped
    assert any(f"{n_skipped} skipped by config.MODEL.WEIGHTS_INIT.SKIP_LAYERS" in w for w in warnings), warnings
    assert any(w.startswith("  skipped trunk weights: trunk._feature_blocks.layer4") for w in warnings), warnings
    # a skipped file key that the model does not have (a head that APPEND_PREFIX put under trunk.) leaves
    # no trunk weight random: no warning (was: "N skipped ... keep their random init")
    caplog.clear()
    extra = dict(trunk, **{"trunk.heads.module.0.clf.weight": torch.zeros(10, 512)})
    torch.save(extra, str(tmp_path / "extra.torch"))
    with caplog.at_level(logging.INFO, logger="ssl_engine.checkpoint"):
        report = ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "extra.torch", STATE_DICT_KEY_NAME="",
                                                                           SKIP_LAYERS=["num_batches_tracked", "heads."]))
    assert "trunk.heads.module.0.clf.weight" in report["skipped"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_init_errors_name_the_file(tmp_path):
    model = resnet18_model()
    with pytest.raises(UserError, match="does not exist"):
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "missing.torch"))
    torch.save({"foo": torch.zeros(2)}, str(tmp_path / "other.torch"))
    with pytest.raises(UserError, match="none of its 1 weights match the model"):
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "other.torch"))
    # a ResNet-18 of twice the width: every name matches, no shape does (BN's counters aside)
    from ssl_engine.models import build_model

    wide = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=2",
                    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[1024,10]}]]"])
    torch.save(build_model(wide.MODEL, wide.OPTIMIZER).state_dict(), str(tmp_path / "wide.torch"))
    with pytest.raises(UserError, match=r"\d+ of its weights are named as the model's but have another shape \(e\.g\. "
                                        r"trunk\._feature_blocks\.conv1\.weight \(128, 3, 7, 7\) vs \(64, 3, 7, 7\), file vs model\), "
                                        r"and none has the model's shape: the file is for another architecture, depth "
                                        r"or width"):
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "wide.torch", STATE_DICT_KEY_NAME=""))
    # a ResNet-50's weights in a ResNet-18: conv1, bn1 and many BatchNorm shapes fit, the rest does not
    # (was: "78 loaded ... 24 shape mismatches", a warning, and a run that trained the mix)
    deep = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=50", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[2048,10]}]]"])
    torch.save(build_model(deep.MODEL, deep.OPTIMIZER).state_dict(), str(tmp_path / "deep.torch"))
    with pytest.raises(UserError, match=r"\d+ of its weights are named as the model's but have another shape "
                                        r"\(e\.g\. trunk\._feature_blocks\.layer1\.0\.conv1\.weight \(64, 64, 1, 1\) vs "
                                        r"\(64, 64, 3, 3\), file vs model\): the file is for another architecture, depth or width"):
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "deep.torch", STATE_DICT_KEY_NAME=""))
    torch.save({"classy_state_dict": {"meta": 3}}, str(tmp_path / "empty.torch"))
    with pytest.raises(CheckpointError, match="holds no weights"):
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "empty.torch"))
    # a DINO-style file: the weights sit under keys of their own, which the error names
    weights = {k: v for k, v in model.state_dict().items()}
    torch.save({"epoch": 3, "teacher": weights, "student": weights}, str(tmp_path / "dino.torch"))
    with pytest.raises(CheckpointError, match=r"holds no weights under STATE_DICT_KEY_NAME='classy_state_dict' \(top-level "
                                              r"keys: epoch, teacher, student\); weights are under 'teacher', 'student': "
                                              r"set config.MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME to one"):
        ck.init_model_from_weights(model, weights_cfg(tmp_path / "dino.torch"))


def vissl_layout_file(path, src, trunk_prefix=""):
    """``src``'s weights saved as VISSL does: classy_state_dict.base_model.model.{trunk, heads}."""
    state = {"trunk": {trunk_prefix + k[6:]: v for k, v in src.state_dict().items() if k.startswith("trunk.")},
             "heads": {k[6:]: v for k, v in src.state_dict().items() if k.startswith("heads.")}}
    torch.save({"classy_state_dict": {"base_model": {"model": state, "meta": {}}}}, str(path))


def test_vissls_documented_prefix_for_torchvision_weights_loads_the_trunk(tmp_path):
    """VISSL's docs load torchvision weights with APPEND_PREFIX=trunk.base_model._feature_blocks.
    (the names inside its feature-evaluation wrapper); this model's trunk has no wrapper, so the
    names are read without base_model. (was: 'none of its weights match the model', exit 2)."""
    src = resnet18_model()
    plain = {k[len("trunk._feature_blocks."):]: v for k, v in src.state_dict().items()
             if k.startswith("trunk._feature_blocks.")}  # conv1.weight, layer1.0.bn1.bias, ... as torchvision names them
    torch.save(plain, str(tmp_path / "torchvision_style.torch"))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(
        tmp_path / "torchvision_style.torch", STATE_DICT_KEY_NAME="", APPEND_PREFIX="trunk.base_model._feature_blocks."))
    assert not report["unexpected"] and not report["shape_mismatch"]
    counters = [k for k in plain if k.endswith("num_batches_tracked")]  # SKIP_LAYERS' default
    assert len(report["loaded"]) == len(plain) - len(counters) and len(report["skipped"]) == len(counters)
    own = model.state_dict()
    for k, v in plain.items():
        if k not in counters:
            assert torch.equal(own["trunk._feature_blocks." + k], v), k


def test_weights_held_as_numpy_arrays_load_as_vissl_loads_them(tmp_path):
    """VISSL's loader takes numpy arrays (its converted Caffe2 models hold them) with
    torch.from_numpy; so does this one (was: 'refused to load ... Unsupported global numpy...').
    An array of Python objects still carries code and is still refused."""
    import numpy as np

    src = resnet18_model()
    state = {"trunk": {k[6:]: v.numpy() for k, v in src.state_dict().items() if k.startswith("trunk.")},
             "heads": {k[6:]: v.half().numpy() if v.is_floating_point() else v.numpy()
                       for k, v in src.state_dict().items() if k.startswith("heads.")}}
    torch.save({"classy_state_dict": {"base_model": {"model": state, "meta": {}}}}, str(tmp_path / "arrays.torch"))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "arrays.torch"))
    assert not report["unexpected"] and not report["shape_mismatch"] and not report["missing"]
    own, want = model.state_dict(), src.state_dict()
    assert torch.equal(own["trunk._feature_blocks.layer4.1.conv2.weight"], want["trunk._feature_blocks.layer4.1.conv2.weight"])
    head = next(k for k in want if k.startswith("heads.") and k.endswith("weight"))
    assert torch.equal(own[head], want[head].half().float())
    torch.save({"w": np.array([object()], dtype=object)}, str(tmp_path / "objects.torch"))
    with pytest.raises(CheckpointError, match="refused to load .*objects.torch: it carries pickled objects"):
        ck.load_checkpoint(tmp_path / "objects.torch")


def test_prefixes_do_not_apply_to_a_classy_state_dict_as_in_vissl(tmp_path, caplog):
    """VISSL's fulltune / low-shot configs set APPEND_PREFIX: trunk. with STATE_DICT_KEY_NAME:
    classy_state_dict; VISSL applies the prefixes only for other STATE_DICT_KEY_NAMEs, and so do we
    (one info line says they were not applied)."""
    import logging

    torch.manual_seed(5)
    src = resnet18_model()
    vissl_layout_file(tmp_path / "vissl.torch", src)
    for kw in ({"APPEND_PREFIX": "trunk."}, {"REMOVE_PREFIX": "module.", "APPEND_PREFIX": "trunk._feature_blocks."}):
        torch.manual_seed(6)
        model = resnet18_model()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ssl_engine.checkpoint"):
            report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "vissl.torch",
                                                                   STATE_DICT_KEY_NAME="classy_state_dict", **kw))
        assert not report["missing"] and not report["unexpected"], kw
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src.state_dict().values()))
        said = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
        assert len(said) == 1 and all(f"{k}={v!r}" in said[0] for k, v in kw.items()), caplog.text
        assert "STATE_DICT_KEY_NAME=classy_state_dict" in said[0]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # another STATE_DICT_KEY_NAME ('' reads the file's classy_state_dict too): the prefix applies, as in VISSL
    with pytest.raises(UserError, match="none of its .* weights match .*'trunk.trunk._feature_blocks.conv1.weight'"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "vissl.torch", STATE_DICT_KEY_NAME="",
                                                                 APPEND_PREFIX="trunk."))


def test_a_file_whose_heads_load_but_none_of_its_trunk_weights_is_refused(tmp_path):
    """A VISSL file whose trunk was saved inside a wrapper (trunk keys 'module._feature_blocks.*'):
    the heads loaded, not one trunk weight did, and the run trained a random trunk under the
    pretrained head after a warning (exit 0). A trunk left out on purpose (SKIP_LAYERS) still loads."""
    src = resnet18_model()
    vissl_layout_file(tmp_path / "wrapped.torch", src, trunk_prefix="module.")
    with pytest.raises(UserError, match=r"none of its \d+ trunk weights match the model's \(first file trunk key "
                                        r"'trunk.module._feature_blocks.conv1.weight'.*only 2 head weights do"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "wrapped.torch",
                                                                 STATE_DICT_KEY_NAME="classy_state_dict"))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "wrapped.torch", STATE_DICT_KEY_NAME="classy_state_dict",
                                                           SKIP_LAYERS=["trunk."]))
    assert sorted(report["loaded"]) == ["heads.0.clf.0.bias", "heads.0.clf.0.weight"], report["loaded"]
    assert torch.equal(model.heads[0].clf[0].weight, src.heads[0].clf[0].weight)


def test_a_vissl_feature_extractor_trunk_loads_without_its_base_model_prefix(tmp_path):
    """A trunk saved by a VISSL feature evaluation is named base_model._feature_blocks.*; VISSL
    drops base_model. for a model that is not a feature extractor, and so do we."""
    torch.manual_seed(7)
    src = resnet18_model()
    vissl_layout_file(tmp_path / "eval.torch", src, trunk_prefix="base_model.")
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "eval.torch", APPEND_PREFIX="trunk."))
    assert not report["missing"] and not report["unexpected"]
    assert torch.equal(model.state_dict()["trunk._feature_blocks.conv1.weight"],
                       src.state_dict()["trunk._feature_blocks.conv1.weight"])


def test_a_deeper_networks_file_is_refused_not_loaded_as_its_first_blocks(tmp_path):
    """A ResNet-34's weights hold every weight of a ResNet-18 with the right shape, and more
    blocks: the run stops naming a block the model lacks (was: exit 0, 82 'unexpected' at INFO,
    a ResNet-18 cut out of a ResNet-34). Listing those blocks in SKIP_LAYERS loads the rest;
    torchvision's own classifier (fc) is no block of the trunk and stays 'unexpected'."""
    torch.save(torchvision.models.resnet34().state_dict(), str(tmp_path / "r34.pth"))
    cfg = weights_cfg(tmp_path / "r34.pth", APPEND_PREFIX="trunk._feature_blocks.")
    with pytest.raises(UserError, match=r"PARAMS_FILE .*r34.pth: 80 of its weights belong to numbered blocks this model "
                                        r"does not have \(e.g. trunk._feature_blocks.layer1.2.conv1.weight\): the file "
                                        r"is for a deeper network; set config.MODEL.TRUNK"):
        ck.init_model_from_weights(resnet18_model(), cfg)
    cfg.WEIGHTS_INIT.SKIP_LAYERS = ["num_batches_tracked", "layer1.2.", "layer2.2.", "layer2.3.", "layer3.2.",
                                    "layer3.3.", "layer3.4.", "layer3.5.", "layer4.2."]
    report = ck.init_model_from_weights(resnet18_model(), cfg)
    assert report["unexpected"] == ["trunk._feature_blocks.fc.weight", "trunk._feature_blocks.fc.bias"]
    # a weight of a module the model has (a bias its convolution lacks) is no missing block either
    r18 = torchvision.models.resnet18().state_dict()
    r18["layer2.0.downsample.0.bias"] = torch.zeros(128)
    torch.save(r18, str(tmp_path / "r18_bias.pth"))
    report = ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "r18_bias.pth",
                                                                      APPEND_PREFIX="trunk._feature_blocks."))
    assert report["unexpected"] == ["trunk._feature_blocks.fc.weight", "trunk._feature_blocks.fc.bias",
                                    "trunk._feature_blocks.layer2.0.downsample.0.bias"]


@pytest.mark.parametrize("file_dims,model_dims,extra", [([12, 8, 6], [12, 8], "fc2"), ([12, 8, 6, 4], [12, 8, 6], "fc3")])
def test_a_deeper_mlps_file_is_refused_also_into_a_one_layer_trunk(tmp_path, file_dims, model_dims, extra):
    """An MLP trunk's layers are its stages: a file with a layer past the model's last stops the
    run, also where the model has a single layer (DIMS of two values, as the quick configs'),
    whose ``fc1`` alone is the trunk's deepest series (was: exit 0, ``fc2`` 'unexpected' at INFO)."""
    from ssl_engine.models import build_model

    def mlp(dims):
        cfg = compose(["config.MODEL.TRUNK.NAME=mlp", f"config.MODEL.TRUNK.MLP.DIMS={dims}", "config.MODEL.HEAD.PARAMS=[]"])
        return cfg, build_model(cfg.MODEL, cfg.OPTIMIZER)

    _, deeper = mlp(file_dims)
    torch.save({"model_state_dict": deeper.state_dict()}, str(tmp_path / "deeper.torch"))
    cfg, model = mlp(model_dims)
    cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = str(tmp_path / "deeper.torch")
    with pytest.raises(UserError, match=rf"deeper.torch: 2 of its weights belong to numbered blocks this model does not "
                                        rf"have \(e.g. trunk._feature_blocks.{extra}.0.weight\): the file is for a deeper "
                                        rf"network"):
        ck.init_model_from_weights(model, cfg.MODEL)
    _, same = mlp(model_dims)  # the same depth's file loads whole
    torch.save({"model_state_dict": same.state_dict()}, str(tmp_path / "same.torch"))
    cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = str(tmp_path / "same.torch")
    report = ck.init_model_from_weights(model, cfg.MODEL)
    assert not report["unexpected"] and not report["missing"] and len(report["loaded"]) == 2 * (len(model_dims) - 1)


def test_a_head_of_another_shape_is_an_error_where_the_heads_are_not_trained(tmp_path):
    """A head of another class count is skipped (the head trains from random init); where the heads
    are frozen or their output is extracted it would give a partly random head's output: an error
    (was: a warning, and features of a half-random head written as complete)."""
    from ssl_engine.models import build_model

    src_cfg = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,7]}]]"])
    vissl_layout_file(tmp_path / "seven.torch", build_model(src_cfg.MODEL, src_cfg.OPTIMIZER))
    report = ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "seven.torch"))
    assert report["shape_mismatch"] == ["heads.0.clf.0.weight (7, 512) vs (10, 512)", "heads.0.clf.0.bias (7,) vs (10,)"]
    says = (r"seven.torch: 2 of its head weights have another shape than the model's \(e.g. heads.0.clf.0.weight "
            r"\(7, 512\) vs \(10, 512\), file vs model\), and the heads are not trained here")
    with pytest.raises(UserError, match=says):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "seven.torch"), heads_used_untrained=True)
    frozen_cfg = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,10]}]]",
                          "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
                          "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD=true",
                          "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_TRUNK_AND_HEAD=true"])
    frozen = build_model(frozen_cfg.MODEL, frozen_cfg.OPTIMIZER)
    frozen_cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = str(tmp_path / "seven.torch")
    with pytest.raises(UserError, match=says):
        ck.init_model_from_weights(frozen, frozen_cfg.MODEL)
    # a run of test phases only (TEST_ONLY) tests the heads as loaded
    from types import SimpleNamespace

    from ssl_engine.tasks.self_supervision_task import SelfSupervisionTask

    test_cfg = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,10]}]]",
                        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'seven.torch'}"])
    task = SimpleNamespace(config=test_cfg, base_model=resnet18_model(), phases=[{"train": False}])
    with pytest.raises(UserError, match=says):
        SelfSupervisionTask.init_weights(task)
    task.phases = [{"train": True}, {"train": False}]  # a training run trains the new head: a warning
    SelfSupervisionTask.init_weights(task)


def test_heads_built_otherwise_than_the_files_are_an_error_where_the_heads_are_not_trained(tmp_path):
    """A file whose head is one mlp of three dims, read into a model of two mlp heads (VISSL's
    kNN and with_head extraction configs' layout): heads.0.clf.0 fits, heads.1 is not in the file.
    Where the heads are frozen or their output is extracted, that output is a partly random
    head's: an error naming both sides (was: 'N missing' at INFO, and kNN accuracies of a
    half-random head printed as those of the file). A run that trains the heads loads what fits."""
    from ssl_engine.models import build_model

    src_cfg = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,512,16],use_relu:true}]]"])
    vissl_layout_file(tmp_path / "one_mlp.torch", build_model(src_cfg.MODEL, src_cfg.OPTIMIZER))

    def two_heads():
        cfg = compose(["config.MODEL.TRUNK.RESNETS.DEPTH=18",
                       "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,512],use_relu:true}],[mlp,{dims:[512,16]}]]"])
        return build_model(cfg.MODEL, cfg.OPTIMIZER)

    says = (r"one_mlp.torch: it sets 2 of the model's head weights but lacks 2 \(e.g. heads.1.clf.0.weight\) and has 2 "
            r"head weights the model lacks \(e.g. heads.0.clf.2.weight\), and the heads are not trained here .*partly "
            r"random; set config.MODEL.HEAD.PARAMS")
    with pytest.raises(UserError, match=says):
        ck.init_model_from_weights(two_heads(), weights_cfg(tmp_path / "one_mlp.torch"), heads_used_untrained=True)
    report = ck.init_model_from_weights(two_heads(), weights_cfg(tmp_path / "one_mlp.torch"))
    assert report["missing"] == ["heads.1.clf.0.weight", "heads.1.clf.0.bias"]
    # a file with no head weights at all (a trunk's) leaves new heads, as before: no error here
    trunk_only = {k: v for k, v in resnet18_model().state_dict().items() if k.startswith("trunk.")}
    torch.save({"model_state_dict": trunk_only}, str(tmp_path / "trunk.torch"))
    report = ck.init_model_from_weights(two_heads(), weights_cfg(tmp_path / "trunk.torch", STATE_DICT_KEY_NAME="model_state_dict"),
                                        heads_used_untrained=True)
    assert not any(k.startswith("heads.") for k in report["loaded"])


def test_a_plain_state_dict_under_the_default_key_name_still_takes_the_prefixes(tmp_path):
    """STATE_DICT_KEY_NAME is classy_state_dict by default; a torchvision file has no such key, so
    its weights are read from the top and the prefixes apply (VISSL would stop on the missing key)."""
    torch.manual_seed(8)
    tv = torchvision.models.resnet18()
    torch.save(tv.state_dict(), str(tmp_path / "tv.pth"))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "tv.pth", APPEND_PREFIX="trunk._feature_blocks."))
    assert torch.equal(model.state_dict()["trunk._feature_blocks.conv1.weight"], tv.state_dict()["conv1.weight"])
    assert "trunk._feature_blocks.fc.weight" in report["unexpected"]


def test_a_vissl_fulltune_config_loads_a_pretraining_through_the_tool(tmp_path):
    """End to end: pretrain a tiny SimCLR, then fine-tune from its final checkpoint the way VISSL's
    fulltune configs say it (EVAL_MODE_ON, STATE_DICT_KEY_NAME: classy_state_dict, APPEND_PREFIX:
    trunk.). With the learning rate at 0 every trunk weight of the fine-tuned run's checkpoint is
    the pretraining's."""
    from conftest import run_tool

    small = ["config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=8", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
             "config.DATA.NUM_DATALOADER_WORKERS=0"]
    pre = tmp_path / "pre"
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={pre}", *small])
    assert r.returncode == 0, r.stderr[-3000:]
    params = pre / "model_final_checkpoint_phase0.torch"
    ft = tmp_path / "ft"
    r = run_tool(["config=quick/supervised_digits", f"config.CHECKPOINT.DIR={ft}", *small, "config.TEST_MODEL=false",
                  "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
                  f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={params}",
                  "config.MODEL.WEIGHTS_INIT.STATE_DICT_KEY_NAME=classy_state_dict",
                  "config.MODEL.WEIGHTS_INIT.APPEND_PREFIX=trunk.",
                  "config.OPTIMIZER.param_schedulers.lr.start_value=0.0",
                  "config.OPTIMIZER.param_schedulers.lr.end_value=0.0"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "config.MODEL.WEIGHTS_INIT.APPEND_PREFIX='trunk.' not applied" in r.stdout
    before = ck.load_checkpoint(params)["classy_state_dict"]["base_model"]["model"]["trunk"]
    after = ck.load_checkpoint(ft / "model_final_checkpoint_phase0.torch")["classy_state_dict"]["base_model"]["model"]["trunk"]
    learned = [k for k in before if "running_" not in k and "num_batches" not in k]
    assert len(learned) > 50 and set(learned) <= set(after)
    assert all(torch.equal(before[k], after[k]) for k in learned)
    # the first run's head (a 64-d projection) is not the fine-tuning's (10 classes), left out by EVAL_MODE_ON
    assert "initialised weights from" in r.stdout and "0 unexpected" in r.stdout


def test_a_named_checkpoint_whose_bytes_changed_is_one_line_and_never_loaded(tmp_path):
    """RESUME_FROM and PARAMS_FILE name one file: where its bytes fail the zip's CRC-32 (a damaged
    disk or copy; torch.load does not notice) the run stops in one line naming the key, exit 2,
    instead of training on other weights. Auto-resume skips such a file (test above)."""
    from conftest import run_tool

    small = ["config=quick/simclr_synthetic", "config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=8",
             "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=0"]
    r = run_tool([*small, f"config.CHECKPOINT.DIR={tmp_path / 'pre'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    damaged = tmp_path / "copy.torch"
    raw = bytearray((tmp_path / "pre" / "model_final_checkpoint_phase0.torch").read_bytes())
    weight = ck.load_checkpoint(tmp_path / "pre" / "model_final_checkpoint_phase0.torch")[
        "classy_state_dict"]["base_model"]["model"]["trunk"]["_feature_blocks.conv1.weight"]
    at = raw.find(weight.flatten()[:16].numpy().tobytes())
    assert at > 0
    raw[at:at + 4] = torch.tensor([123.0]).numpy().tobytes()
    damaged.write_bytes(bytes(raw))
    for key, extra in (("config.CHECKPOINT.RESUME_FROM", ["config.OPTIMIZER.num_epochs=2"]),
                       ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE", []),
                       ("config.CHECKPOINT.RESUME_FROM", ["engine_name=extract_features", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]"])):
        out = tmp_path / f"{key.rsplit('.', 1)[1]}_{len(extra)}"
        r = run_tool([*small, *extra, f"config.CHECKPOINT.DIR={out}", f"{key}={damaged}"])
        assert r.returncode == 2, (key, r.stdout[-2000:], r.stderr[-2000:])
        assert f"{key}: {damaged} is corrupt: the stored checksum of its record" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not out.exists(), "the check comes before the run's folder is made"


def test_a_file_saved_without_checksums_is_not_called_damaged(tmp_path):
    """torch.serialization.set_crc32_options(False) writes 0 as every record's CRC-32: such a file
    (from another tool) has nothing to check and loads, while a changed byte of a file with
    checksums is found (test above)."""
    path = tmp_path / "nocrc.torch"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(1000)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert ck.damaged_record(path) is None
    ck.check_intact(path, "config.MODEL.WEIGHTS_INIT.PARAMS_FILE")
    torch.save({"w": torch.ones(1000)}, tmp_path / "crc.torch")
    assert ck.damaged_record(tmp_path / "crc.torch") is None


def test_a_dino_checkpoint_with_its_args_loads_and_the_prefix_error_names_the_settings_that_fit(tmp_path):
    """DINO's (and other repositories') checkpoints keep the training arguments as an
    argparse.Namespace under ``args``: such a file was refused as unsafe. The teacher's names
    (``backbone.conv1.weight``) match the model's only with both prefix settings; the error says which."""
    import argparse
    import os

    torch.manual_seed(5)
    tv = torchvision.models.resnet18()
    teacher = {"backbone." + k: v for k, v in tv.state_dict().items() if not k.startswith("fc.")}
    teacher["head.mlp.0.weight"] = torch.zeros(16, 512)
    torch.save({"teacher": teacher, "student": {"module." + k: v for k, v in teacher.items()}, "epoch": 100,
                "args": argparse.Namespace(arch="resnet18", out_dim=65536, lr=5e-4, local_crops_scale=(0.05, 0.4))},
               str(tmp_path / "dino.pth"))
    assert ck.load_checkpoint(tmp_path / "dino.pth")["args"].arch == "resnet18"
    with pytest.raises(UserError) as e:
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "dino.pth", STATE_DICT_KEY_NAME="teacher"))
    advice = ("config.MODEL.WEIGHTS_INIT.REMOVE_PREFIX=backbone. and config.MODEL.WEIGHTS_INIT.APPEND_PREFIX="
              "trunk._feature_blocks. map 100 of them onto the model's names")
    assert "none of its 121 weights match the model" in str(e.value) and str(e.value).endswith(advice), str(e.value)
    with pytest.raises(UserError, match="REMOVE_PREFIX=module.backbone. and .*APPEND_PREFIX=trunk._feature_blocks. map 100"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "dino.pth", STATE_DICT_KEY_NAME="student"))
    # the count is of weights the run would load: those SKIP_LAYERS names are left out (its default, BatchNorm's
    # num_batches_tracked, leaves 100 of the 120; SKIP_LAYERS=[layer4] instead leaves 90)
    with pytest.raises(UserError, match="APPEND_PREFIX=trunk._feature_blocks. map 90 of them"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "dino.pth", STATE_DICT_KEY_NAME="teacher",
                                                                 SKIP_LAYERS=["layer4"]))
    model = resnet18_model()
    report = ck.init_model_from_weights(model, weights_cfg(tmp_path / "dino.pth", STATE_DICT_KEY_NAME="teacher",
                                                           REMOVE_PREFIX="backbone.", APPEND_PREFIX="trunk._feature_blocks."))
    assert torch.equal(model.state_dict()["trunk._feature_blocks.layer4.1.conv2.weight"], tv.state_dict()["layer4.1.conv2.weight"])
    assert len(report["loaded"]) == 100  # BatchNorm's num_batches_tracked are skipped by default
    # the Namespace's attributes go through the same restricted reader: a function in it is refused
    torch.save({"teacher": teacher, "args": argparse.Namespace(run=os.system)}, str(tmp_path / "bad.pth"))
    with pytest.raises(CheckpointError, match="loading it would run code"):
        ck.load_checkpoint(tmp_path / "bad.pth")


def test_a_file_whose_weights_are_not_named_by_strings_is_the_no_match_error(tmp_path):
    torch.save({0: torch.ones(3), 1: torch.ones(2)}, str(tmp_path / "ints.pth"))
    with pytest.raises(UserError, match="none of its 2 weights match the model.*set REMOVE_PREFIX / APPEND_PREFIX"):
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "ints.pth", STATE_DICT_KEY_NAME=""))


@pytest.mark.parametrize("kind", ["shard_list", "shard", "slice_list"])
def test_a_vissl_fsdp_checkpoint_is_named_as_such_with_the_conversion_to_run(tmp_path, kind):
    """VISSL's FSDP runs write files that hold no weights under the model's names: the file a
    checkpoint name points to lists the shards (type shard_list), each rank's shard holds flattened
    parameters (shard), and VISSL's converter can write one file per weight (slice_list: the
    trunk/heads hold file paths). They were 'holds no weights under STATE_DICT_KEY_NAME=...' (the
    sliced one has them, as paths) or 'none of its weights match the model' with no way out."""
    src = resnet18_model()
    trunk = {k[len("trunk."):]: v for k, v in src.state_dict().items() if k.startswith("trunk.")}
    data = {
        "shard_list": {"type": "shard_list", "shards": ["model_phase3_shard0.torch", "model_phase3_shard1.torch"]},
        "shard": {"type": "shard", "phase_idx": 3, "classy_state_dict": {"base_model": {
            "model": {"trunk": {"_fsdp_wrapped_module.flat_param_0": torch.zeros(100)}, "heads": {}},
            "meta": {"trunk": {}}}}},
        "slice_list": {"type": "slice_list", "classy_state_dict": {"base_model": {"model": {
            "trunk": {k: f"/ckpt/model_phase3_layers/{i}.torch" for i, k in enumerate(trunk)}, "heads": {}}}}},
    }[kind]
    path = tmp_path / "model_phase3.torch"
    torch.save(data, str(path))
    model = resnet18_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        ck.init_model_from_weights(model, weights_cfg(path))
    msg = str(e.value)
    assert msg.startswith(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path} is a VISSL FSDP checkpoint of type '{kind}'"), msg
    assert "convert_sharded_checkpoint.py" in msg and "-t consolidated" in msg and "\n" not in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_extraction_resumed_from_a_model_only_file_names_the_key_and_params_file(tmp_path):
    """config.CHECKPOINT.RESUME_FROM of an extraction naming VISSL's model-only file ({"model":
    {"trunk", "heads"}}) said '<file> holds no classy_state_dict.base_model' without the key that
    named it; the line names config.CHECKPOINT.RESUME_FROM, the file's keys and PARAMS_FILE."""
    from conftest import run_tool

    src = resnet18_model()
    model = {part: {k[len(part) + 1:]: v for k, v in src.state_dict().items() if k.startswith(part + ".")}
             for part in ("trunk", "heads")}
    path = tmp_path / "model_only.torch"
    torch.save({"model": model}, str(path))
    r = run_tool(["config=extract/simclr_digits_trunk", "config.DATA.TRAIN.DATA_LIMIT=8", "config.DATA.TEST.DATA_LIMIT=8",
                  f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.EXTRACT_FEATURES.OUTPUT_DIR={tmp_path / 'feats'}",
                  f"config.CHECKPOINT.RESUME_FROM={path}"])
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert err[-1].startswith(f"error: config.CHECKPOINT.RESUME_FROM: {path} holds no classy_state_dict.base_model "
                              f"(top-level keys: 'model')"), err[-1]
    assert "config.MODEL.WEIGHTS_INIT.PARAMS_FILE" in err[-1]


def test_a_folder_of_vissl_fsdp_checkpoints_is_skipped_saying_what_they_are(tmp_path, caplog):
    """A folder VISSL trained in with FSDP holds model_phase{N}.torch listing the shards: the
    resume skipped it as 'not an ssl_engine checkpoint'; the warning says it is VISSL's FSDP
    checkpoint and how to start from its weights."""
    torch.save({"type": "shard_list", "shards": ["model_phase0_shard0.torch"]}, str(tmp_path / "model_phase0.torch"))
    with caplog.at_level("WARNING"):
        assert ck.newest_good_checkpoint(tmp_path) is None
    assert ("skipping checkpoint model_phase0.torch: it is a VISSL FSDP checkpoint (type 'shard_list'), which cannot "
            "be resumed here") in caplog.text, caplog.text
    assert "convert_sharded_checkpoint.py" in caplog.text and "config.MODEL.WEIGHTS_INIT.PARAMS_FILE" in caplog.text


def test_the_state_dict_key_name_error_says_what_the_empty_name_would_read(tmp_path):
    """The error for a STATE_DICT_KEY_NAME the file lacks said "'' reads the file itself as the
    weights" also for a VISSL checkpoint, where '' reads its classy_state_dict: it names that key."""
    src = resnet18_model()
    trunk = {k[len("trunk."):]: v for k, v in src.state_dict().items() if k.startswith("trunk.")}
    torch.save({"classy_state_dict": {"base_model": {"model": {"trunk": trunk, "heads": {}}, "meta": {}}},
                "phase_idx": 3, "iteration": 40}, str(tmp_path / "vissl.torch"))
    with pytest.raises(CheckpointError) as e:
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "vissl.torch", STATE_DICT_KEY_NAME="model"))
    assert str(e.value).endswith("; '' reads its 'classy_state_dict' (the first of classy_state_dict, model_state_dict, "
                                 "state_dict, model it holds)"), str(e.value)
    torch.save(dict(trunk), str(tmp_path / "bare.torch"))
    with pytest.raises(CheckpointError) as e:
        ck.init_model_from_weights(resnet18_model(), weights_cfg(tmp_path / "bare.torch", STATE_DICT_KEY_NAME="model"))
    assert str(e.value).endswith("; '' reads the file itself as the weights"), str(e.value)


def test_pid_alive_counts_a_zombie_as_gone():
    """A process that ended but was not yet reaped by its parent (a launcher killed under a shell
    that has not waited for it) is a zombie: kill(pid, 0) still finds it, yet it runs no more. The
    forkserver ranks and loader workers that watch their launcher by pid must see it gone."""
    import subprocess
    import sys
    import time

    from ssl_engine.processes import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.time() + 30
        while time.time() < deadline:  # not reaped: Popen.poll / wait are not called yet
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    break
            time.sleep(0.05)
        assert not pid_alive(child.pid)
        assert pid_alive(os.getpid())
    finally:
        child.wait()
    assert not pid_alive(child.pid)
