"""The torchvision_dataset source: CIFAR-10/100, MNIST, STL-10 and SVHN read from tiny files written
in each on-disk format (tests/tv_formats.py), compared pixel for pixel with what was written and
with torchvision's own classes on the same folders; pickling to loader workers; user errors; and
one supervised run through the real tool on a fake CIFAR-10 folder."""

import gzip
import json
import pickle
import re
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torchvision.datasets as tvd
from PIL import Image

from conftest import run_tool
from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.data import build_dataloader, build_dataset
from ssl_engine.data import torchvision_dataset as tvsrc
from ssl_engine.data.torchvision_dataset import TORCHVISION_DATASETS, TorchvisionDatasetSource
from ssl_engine.errors import UserError
from ssl_engine.registry import DATA_SOURCES
from tv_formats import idx_bytes, make_split, py2_pickle, write_cifar, write_dataset, write_mnist

SPLITS = ("TRAIN", "TEST")


def cfg_for(name: Any, root: Any, split: str = "TRAIN", **keys: Any) -> AttrDict:
    scfg: Dict[str, Any] = {
        "DATA_SOURCES": ["torchvision_dataset"], "DATA_PATHS": [str(root)], "DATASET_NAMES": [name],
        "LABEL_SOURCES": ["torchvision_dataset"], "LABEL_PATHS": [], "LABEL_TYPE": "standard", "DATA_LIMIT": -1,
        "BATCHSIZE_PER_REPLICA": 2, "DROP_LAST": False, "TRANSFORMS": [], "COLLATE_FUNCTION": "default_collate",
        "COLLATE_FUNCTION_PARAMS": {},
    }
    scfg.update(keys)
    return AttrDict({"SEED_VALUE": 0, "MULTI_PROCESSING_METHOD": "fork",
                     "DATA": {"NUM_DATALOADER_WORKERS": 0, "PIN_MEMORY": False, split: scfg}})


def source(name: str, root: Any, split: str = "TRAIN", index: int = 0, **keys: Any) -> TorchvisionDatasetSource:
    return TorchvisionDatasetSource(cfg_for(name, root, split, **keys), str(root), split, index)


def as_rgb(image: np.ndarray) -> np.ndarray:
    """What the source returns for a written image: MNIST's grayscale repeated into R, G, B."""
    return np.repeat(image[:, :, None], 3, axis=2) if image.ndim == 2 else image


def assert_reads_back(src: TorchvisionDatasetSource, images: np.ndarray, labels: np.ndarray) -> None:
    assert len(src) == len(images)
    got = src.labels()
    assert got.dtype == np.int64 and got.tolist() == labels.tolist()
    for i in range(len(images)):
        img = src.get(i)
        assert isinstance(img, Image.Image) and img.mode == "RGB"
        assert np.array_equal(np.asarray(img), as_rgb(images[i])), f"image {i} differs"


# ----------------------------------------------------------------------------- reading each format


def test_registered_as_a_data_source():
    assert DATA_SOURCES.get("torchvision_dataset") is TorchvisionDatasetSource
    assert TORCHVISION_DATASETS == ("CIFAR10", "CIFAR100", "MNIST", "STL10", "SVHN")


@pytest.mark.parametrize("name", TORCHVISION_DATASETS)
def test_each_format_reads_back_the_pixels_and_labels_written(tmp_path, name):
    train, test = write_dataset(name, tmp_path)
    for split, (images, labels) in zip(SPLITS, (train, test)):
        assert_reads_back(source(name, tmp_path, split), images, labels)


def test_the_name_is_case_insensitive_and_picked_per_source_index(tmp_path):
    train, _ = write_dataset("CIFAR10", tmp_path)
    assert_reads_back(source("cifar10", tmp_path), *train)
    src = source("ignored", tmp_path, index=1, DATASET_NAMES=["SVHN", "Cifar10"])
    assert src.name == "CIFAR10"
    assert_reads_back(src, *train)


def test_mnist_gz_files_are_read_where_only_those_exist(tmp_path):
    train = make_split(5, 28, 10, 3, channels=0)
    test = make_split(3, 28, 10, 4, channels=0)
    write_mnist(tmp_path, train, test, gz=True)
    assert_reads_back(source("MNIST", tmp_path, "TRAIN"), *train)
    assert_reads_back(source("MNIST", tmp_path, "TEST"), *test)


def test_svhn_uncompressed_mat_and_the_digit_zero(tmp_path):
    from tv_formats import write_svhn

    train = (make_split(4, 32, 10, 5)[0], np.array([0, 0, 3, 9]))  # written as 10, 10, 3, 9
    write_svhn(tmp_path, train, train, compress=False)
    assert_reads_back(source("SVHN", tmp_path), *train)


def test_a_cifar_batch_re_saved_by_python3_reads_the_same(tmp_path):
    """Files re-pickled by Python 3 name other globals (numpy._core, _codecs.encode, _frombuffer)."""
    train, test = write_dataset("CIFAR100", tmp_path)
    folder = tmp_path / "cifar-100-python"
    for protocol in (2, 3, 5):
        for split, fname, (images, labels) in (("TRAIN", "train", train), ("TEST", "test", test)):
            entry = pickle.loads((folder / fname).read_bytes(), encoding="latin1")
            (folder / fname).write_bytes(pickle.dumps(entry, protocol=protocol))
            assert_reads_back(source("CIFAR100", tmp_path, split), images, labels)


# ----------------------------------------------------------------------------- same as torchvision


def torchvision_class(name: str, root: Path, split: str, monkeypatch: Any) -> Any:
    """torchvision's own class on ``root``; its md5 checks (of the real files) switched off."""
    train = split == "TRAIN"
    cls = getattr(tvd, name)
    if name != "MNIST":  # MNIST checks only that its files exist
        monkeypatch.setattr(cls, "_check_integrity", lambda self: True)
    if name in ("CIFAR10", "CIFAR100"):
        monkeypatch.setattr(tvd.cifar, "check_integrity", lambda *a, **k: True)  # batches.meta / meta
        return cls(str(root), train=train, download=False)
    if name == "MNIST":
        return cls(str(root), train=train, download=False)
    return cls(str(root), split="train" if train else "test", download=False)


@pytest.mark.parametrize("name", TORCHVISION_DATASETS)
def test_same_images_and_labels_as_torchvisions_own_class(tmp_path, monkeypatch, name):
    write_dataset(name, tmp_path)
    for split in SPLITS:
        ours = source(name, tmp_path, split)
        theirs = torchvision_class(name, tmp_path, split, monkeypatch)
        assert len(ours) == len(theirs)
        for i in range(len(theirs)):
            image, target = theirs[i]
            assert int(ours.labels()[i]) == target
            assert np.array_equal(np.asarray(ours.get(i)), np.asarray(image.convert("RGB")))


# ----------------------------------------------------------------------------- workers, datasets


def test_a_pickled_source_leaves_the_images_behind_and_reads_them_again(tmp_path):
    n = 200
    images, labels = make_split(n, 32, 10, 7)
    write_cifar(tmp_path, "CIFAR10", (images, labels), make_split(4, 32, 10, 8))
    src = source("CIFAR10", tmp_path)
    first = np.asarray(src.get(123))  # the rank reads (and keeps) the images
    assert src._images is not None
    blob = pickle.dumps(src)
    assert len(blob) < images.nbytes / 4, f"{len(blob)} bytes: the decoded images went into the pickle"
    copy = pickle.loads(blob)
    assert copy._images is None and len(copy) == n and copy.labels().tolist() == labels.tolist()
    assert np.array_equal(np.asarray(copy.get(123)), first)
    assert np.array_equal(first, images[123])


def test_build_dataset_takes_the_labels_from_the_data_source_and_loads_batches(tmp_path, monkeypatch):
    """LABEL_SOURCES [torchvision_dataset] beside the same data source reuses it: the files are
    read once. (A loader worker, which gets the source pickled, runs in the test through the tool.)"""
    train, _ = write_dataset("CIFAR10", tmp_path, n_train=8)
    cfg = cfg_for("CIFAR10", tmp_path, TRANSFORMS=[{"name": "ToTensor"}], BATCHSIZE_PER_REPLICA=4)
    reads = []
    cifar = type(tvsrc._FORMATS["CIFAR10"])
    monkeypatch.setattr(cifar, "read", lambda self, paths, _read=cifar.read: reads.append(paths) or _read(self, paths))
    dataset = build_dataset(cfg, "TRAIN")
    assert dataset.get_labels().tolist() == train[1].tolist()
    assert len(reads) == 1
    loader = build_dataloader(dataset, cfg, "TRAIN", 0, 1, "cpu")
    seen: Dict[int, Any] = {}
    for batch in loader:
        for k, idx in enumerate(batch["data_idx"][0].tolist()):
            seen[idx] = (batch["data"][0][k], int(batch["label"][0][k]))
    assert sorted(seen) == list(range(8))
    for idx, (tensor, label) in seen.items():
        assert label == train[1][idx]
        assert np.array_equal((tensor.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), train[0][idx])


def test_a_label_source_of_its_own_reads_the_same_labels(tmp_path):
    """LABEL_SOURCES [torchvision_dataset] beside another data source builds its own reader."""
    train, _ = write_dataset("MNIST", tmp_path, n_train=6)
    cfg = cfg_for("MNIST", tmp_path, DATA_SOURCES=["synthetic"], DATA_PATHS=[], LABEL_PATHS=[str(tmp_path)],
                  DATA_LIMIT=6, SYNTHETIC_IMAGE_SIZE=4)
    assert build_dataset(cfg, "TRAIN").get_labels().tolist() == train[1].tolist()


# ----------------------------------------------------------------------------- user errors


def test_unknown_and_missing_dataset_names(tmp_path):
    with pytest.raises(UserError, match=r"config.DATA.TRAIN.DATASET_NAMES\[0\]='CIFAR-10' is not a data set the "
                                        r"torchvision_dataset source reads \(did you mean 'CIFAR10'.*valid: CIFAR10, "
                                        r"CIFAR100, MNIST, STL10, SVHN"):
        source("CIFAR-10", tmp_path)
    with pytest.raises(UserError, match=r"DATASET_NAMES\[0\]='imagenet1k_folder'"):
        source("imagenet1k_folder", tmp_path)  # VISSL's default, left in place
    with pytest.raises(UserError, match=r"config.DATA.TEST.DATASET_NAMES has 1 name\(s\), so "
                                        r"config.DATA.TEST.DATASET_NAMES\[1\] is missing.*one of CIFAR10"):
        source("CIFAR10", tmp_path, "TEST", index=1)


def test_missing_root_or_files_say_what_is_expected_and_that_nothing_is_downloaded(tmp_path):
    with pytest.raises(UserError, match=r"config.DATA.TRAIN.DATA_PATHS\[0\] is missing"):
        TorchvisionDatasetSource(cfg_for("CIFAR10", ""), "", "TRAIN", 0)
    nowhere = tmp_path / "nowhere"
    with pytest.raises(UserError) as e:
        source("STL10", nowhere, "TEST")
    msg = str(e.value)
    for text in (f"config.DATA.TEST.DATA_PATHS[0]: '{nowhere}' does not exist", "stl10_binary/test_X.bin",
                 "never downloads", f"torchvision.datasets.STL10('{nowhere}', split='test', download=True)"):
        assert text in msg, msg
    write_dataset("CIFAR10", tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(UserError) as e:
        source("CIFAR10", tmp_path)
    msg = str(e.value)
    for text in (f"'{tmp_path}/cifar-10-batches-py/data_batch_4' is missing", "cifar-10-batches-py/data_batch_1, ",
                 "never downloads", "train=True, download=True"):
        assert text in msg, msg
    source("CIFAR10", tmp_path, "TEST")  # the test split has its file


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("name, rel, keep, problem", [
    ("CIFAR10", "cifar-10-batches-py/data_batch_2", 500, "is truncated or corrupt"),
    ("CIFAR100", "cifar-100-python/test", 100, "is truncated or corrupt"),
    ("MNIST", "MNIST/raw/train-images-idx3-ubyte", 1000, "is truncated or corrupt: its header says 6 x 28 x 28"),
    ("MNIST", "MNIST/raw/t10k-labels-idx1-ubyte", 6, "is truncated: it ends inside its header"),
    ("MNIST", "MNIST/raw/t10k-labels-idx1-ubyte", 10, "is truncated or corrupt: its header says 4 uint8 (12 bytes"),
    ("STL10", "stl10_binary/train_X.bin", 30000, "is truncated or corrupt: 30000 bytes"),
    ("STL10", "stl10_binary/test_y.bin", 3, "holds 3 labels (one byte each)"),
    ("SVHN", "train_32x32.mat", 100, "is truncated or not a MATLAB file"),
    ("SVHN", "train_32x32.mat", 400, "is truncated or not an SVHN file: it holds no 'y'"),
])
def test_a_truncated_file_names_the_file_and_the_problem(tmp_path, name, rel, keep, problem):
    write_dataset(name, tmp_path)
    truncate(tmp_path / rel, keep)
    split = "TEST" if "test" in rel or "t10k" in rel else "TRAIN"
    with pytest.raises(UserError) as e:
        source(name, tmp_path, split)
    msg = str(e.value)
    assert f"config.DATA.{split}.DATA_PATHS[0]: {name} file '{tmp_path / rel}' {problem}" in msg, msg
    assert "remove it and fetch the data again" in msg, msg


def test_mnist_gz_truncated_and_foreign_idx(tmp_path):
    write_dataset("MNIST", tmp_path)
    raw = tmp_path / "MNIST" / "raw"
    data = (raw / "train-images-idx3-ubyte").read_bytes()
    (raw / "train-images-idx3-ubyte").unlink()
    (raw / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data)[:-40])
    with pytest.raises(UserError, match=r"train-images-idx3-ubyte.gz' is truncated"):
        source("MNIST", tmp_path)
    (raw / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros((4, 2), dtype=np.uint8)))
    with pytest.raises(UserError, match=r"t10k-labels-idx1-ubyte' is an idx file of type 0x08 with 2 dims; MNIST's is "
                                        r"uint8 \(0x08\) with 1 dims"):
        source("MNIST", tmp_path, "TEST")
    (raw / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(3, dtype=np.uint8)))
    with pytest.raises(UserError, match=r"t10k-labels-idx1-ubyte' holds 3 labels but .*t10k-images-idx3-ubyte' holds 4"):
        source("MNIST", tmp_path, "TEST")


class Payload:
    """Unpickling this would create a marker file; the CIFAR reader must refuse it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_cifar_pickle_asking_for_other_globals_is_refused_without_running_it(tmp_path):
    write_dataset("CIFAR10", tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    marker = tmp_path / "PWNED"
    batch.write_bytes(pickle.dumps({"data": Payload(str(marker)), "labels": [0]}, protocol=2))
    with pytest.raises(UserError) as e:
        source("CIFAR10", tmp_path, "TEST")
    assert not marker.exists()
    msg = str(e.value)
    # open pickles as io.open or _io.open, depending on the Python version
    assert re.search(re.escape(f"'{batch}' is not a CIFAR batch: its pickle asks for more than numpy arrays "
                               f"(refused the global ") + r"_?io\.open; never loaded", msg), msg
    batch.write_bytes(py2_pickle({"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [0, 1, 2]}))
    with pytest.raises(UserError, match=r"its 'labels' are int64 \(3,\), expected 2 integers"):
        source("CIFAR10", tmp_path, "TEST")
    batch.write_bytes(py2_pickle({"data": np.zeros((2, 3072), dtype=np.uint8), "fine_labels": [0, 1]}))
    with pytest.raises(UserError, match=r"has no 'labels' \(keys: data, fine_labels\)"):
        source("CIFAR10", tmp_path, "TEST")


def test_dataset_names_is_read_so_setting_it_is_not_called_unused(caplog):
    import logging

    from ssl_engine.config import compose

    quick = "config=quick/supervised_digits"
    with caplog.at_level(logging.WARNING):
        compose([quick, "config.DATA.TRAIN.DATA_SOURCES=[torchvision_dataset]", "config.DATA.TRAIN.DATASET_NAMES=[MNIST]"])
    assert "DATASET_NAMES" not in caplog.text, caplog.text
    with caplog.at_level(logging.WARNING):
        compose([quick, "config.DATA.TEST.DATASET_NAMES=[my_catalog_entry]"])  # digits ignores it: say so
    assert "config.DATA.TEST.DATASET_NAMES is read only by the torchvision_dataset source" in caplog.text, caplog.text


# ----------------------------------------------------------------------------- through the tool


CIFAR_RUN = """\
# @package _global_
engine_name: train
config:
  LOG_FREQUENCY: 1
  TEST_MODEL: true
  TEST_EVERY_NUM_EPOCH: 1
  SEED_VALUE: 0
  DATA:
    NUM_DATALOADER_WORKERS: 1
    PIN_MEMORY: false
    TRAIN:
      DATA_SOURCES: [torchvision_dataset]
      LABEL_SOURCES: [torchvision_dataset]
      DATASET_NAMES: [CIFAR10]
      DATA_PATHS: [{root}]
      BATCHSIZE_PER_REPLICA: 16
      TRANSFORMS:
        - name: RandomHorizontalFlip
        - name: ToTensor
    TEST:
      DATA_SOURCES: [torchvision_dataset]
      LABEL_SOURCES: [torchvision_dataset]
      DATASET_NAMES: [cifar10]
      DATA_PATHS: [{root}]
      BATCHSIZE_PER_REPLICA: 16
      TRANSFORMS:
        - name: ToTensor
  METERS:
    names: [accuracy_list_meter]
  MACHINE:
    DEVICE: cpu
  MODEL:
    TRUNK:
      NAME: mlp
      MLP:
        DIMS: [3072, 16]
    HEAD:
      PARAMS: [[mlp, {{dims: [16, 10]}}]]
  LOSS:
    name: cross_entropy_multiple_output_single_target
  OPTIMIZER:
    name: sgd
    num_epochs: 1
    param_schedulers:
      lr:
        name: constant
        value: 0.1
  DISTRIBUTED:
    NUM_NODES: 1
    NUM_PROC_PER_NODE: 1
  CHECKPOINT:
    DIR: {run}
"""


def test_a_supervised_run_on_a_cifar10_folder_through_the_tool(tmp_path):
    root = tmp_path / "cifar"
    write_dataset("CIFAR10", root, n_train=64, n_test=32)
    run = tmp_path / "run"
    config = tmp_path / "cifar_run.yaml"
    config.write_text(CIFAR_RUN.format(root=root, run=run))
    proc = run_tool([f"config={config}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.json").read_text().splitlines()]
    tests = [m for m in metrics if "test_accuracy_list_meter" in m]
    assert len(tests) == 1 and 0.0 <= tests[0]["test_accuracy_list_meter"]["top_1"]["0"] <= 100.0, metrics
    assert any("train_accuracy_list_meter" in m for m in metrics), metrics
    steps = [json.loads(line) for line in (run / "stdout.json").read_text().splitlines()]
    assert steps and steps[-1]["iteration"] == 4, steps  # 64 images in batches of 16

