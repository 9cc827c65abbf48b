"""Tests of ssl_engine.data: sources, seeded dataset, transforms, collators, sampler, loader."""

import logging
import os
import random
import re
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from PIL import Image
import torchvision.transforms as T

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.data import (
    SSLDataset,
    StatefulDistributedSampler,
    build_collator,
    build_dataloader,
    build_dataset,
    build_transform,
    default_collate,
    get_loader_state,
    set_loader_position,
    simclr_collator,
)
from ssl_engine.data.transforms import SSLTransformsWrapper, labelling_transform
from ssl_engine.errors import UserError
from ssl_engine.registry import COLLATORS, DATA_SOURCES, TRANSFORMS

# ----------------------------------------------------------------------------- helpers


def make_cfg(split: str = "TRAIN", seed: int = 0, workers: int = 0, **split_keys: Any) -> AttrDict:
    """A full config with one split filled in (only the keys the data code reads)."""
    scfg: Dict[str, Any] = {
        "DATA_SOURCES": ["synthetic"],
        "DATA_PATHS": [],
        "LABEL_SOURCES": ["synthetic"],
        "LABEL_PATHS": [],
        "LABEL_TYPE": "standard",
        "DATA_LIMIT": 40,
        "BATCHSIZE_PER_REPLICA": 4,
        "DROP_LAST": False,
        "TRANSFORMS": [],
        "COLLATE_FUNCTION": "default_collate",
        "COLLATE_FUNCTION_PARAMS": {},
        "SYNTHETIC_IMAGE_SIZE": 16,
    }
    scfg.update(split_keys)
    return AttrDict(
        {
            "SEED_VALUE": seed,
            "MULTI_PROCESSING_METHOD": "fork",
            "DATA": {"NUM_DATALOADER_WORKERS": workers, "PIN_MEMORY": False, split: scfg},
        }
    )


AUG = [
    {"name": "RandomResizedCrop", "size": 12},
    {"name": "RandomHorizontalFlip"},
    {"name": "ImgPilColorDistortion", "strength": 1.0},
    {"name": "ToTensor"},
]
SIMCLR_AUG = [{"name": "ImgReplicatePil", "num_times": 2}] + AUG


def write_image_tree(root: str, classes: Dict[str, int], size: int = 8) -> None:
    """``classes[name]`` images under ``root/name/``, each a different solid colour."""
    for c, (name, count) in enumerate(sorted(classes.items())):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in range(count):
            Image.new("RGB", (size, size), (c * 40, i * 10, 100)).save(os.path.join(root, name, f"img{i}.png"))


def tensors_equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- sources


def test_registries_hold_the_builtins() -> None:
    for name in ("synthetic", "digits", "disk_folder", "disk_filelist", "torchvision_dataset"):
        assert name in DATA_SOURCES
    for name in ("default_collate", "default", "simclr_collator"):
        assert name in COLLATORS
    for name in (
        "RandomResizedCrop", "Resize", "CenterCrop", "RandomHorizontalFlip", "ToTensor", "Normalize",
        "ColorJitter", "RandomGrayscale", "GaussianBlur", "ImgReplicatePil", "ImgPilColorDistortion",
        "ImgPilGaussianBlur", "ImgPilToMultiCrop",
    ):
        assert name in TRANSFORMS
    assert "InterpolationMode" not in TRANSFORMS


def test_synthetic_length_labels_and_determinism() -> None:
    ds = build_dataset(make_cfg(DATA_LIMIT=-1, SYNTHETIC_NUM_CLASSES=5), "TRAIN")
    assert len(ds) == 1000
    labels = ds.get_labels()
    assert labels.shape == (1000,) and set(labels.tolist()) == set(range(5))
    small = build_dataset(make_cfg(DATA_LIMIT=30), "TRAIN")
    assert len(small) == 30
    img = small.sources[0].get(3)
    assert img.mode == "RGB" and img.size == (16, 16)
    # a pure function of (SEED_VALUE, split, i)
    again = build_dataset(make_cfg(DATA_LIMIT=30), "TRAIN").sources[0].get(3)
    assert np.array_equal(np.asarray(img), np.asarray(again))
    other_seed = build_dataset(make_cfg(seed=1, DATA_LIMIT=30), "TRAIN").sources[0].get(3)
    assert not np.array_equal(np.asarray(img), np.asarray(other_seed))
    test_img = build_dataset(make_cfg("TEST", DATA_LIMIT=30), "TEST").sources[0].get(3)
    assert not np.array_equal(np.asarray(img), np.asarray(test_img))
    # the first 30 labels do not depend on the length
    assert np.array_equal(small.get_labels(), build_dataset(make_cfg(DATA_LIMIT=-1), "TRAIN").get_labels()[:30])


def test_synthetic_classes_are_learnable() -> None:
    """A nearest-class-mean classifier on raw pixels beats chance by far on TEST."""
    tr = build_dataset(make_cfg(DATA_LIMIT=300), "TRAIN")
    te = build_dataset(make_cfg("TEST", DATA_LIMIT=100), "TEST")

    def pixels(ds: SSLDataset) -> np.ndarray:
        return np.stack([np.asarray(ds.sources[0].get(i), dtype=np.float32).ravel() for i in range(len(ds))])

    x, y, xt, yt = pixels(tr), tr.get_labels(), pixels(te), te.get_labels()
    means = np.stack([x[y == c].mean(0) for c in range(10)])
    pred = ((xt[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == yt).mean() > 0.6


def test_data_limit_sampling_without_a_data_limit_says_it_has_no_effect(caplog: Any) -> None:
    """SKIP_NUM_SAMPLES and IS_BALANCED choose within a DATA_LIMIT subset (as in VISSL): without
    one they do nothing, which the log says instead of training on the data unchanged in silence."""
    sampling = {"SKIP_NUM_SAMPLES": 50, "IS_BALANCED": True, "SEED": 0}
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.dataset"):
        ds = build_dataset(make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=-1,
                                    DATA_LIMIT_SAMPLING=sampling), "TRAIN")
    assert len(ds) == round(0.8 * 1797)
    assert ("config.DATA.TRAIN.DATA_LIMIT_SAMPLING SKIP_NUM_SAMPLES=50 and IS_BALANCED=True: no effect with "
            "DATA_LIMIT=-1 (all samples); set config.DATA.TRAIN.DATA_LIMIT") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.dataset"):
        build_dataset(make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=100,
                               DATA_LIMIT_SAMPLING=sampling), "TRAIN")
    assert "no effect" not in caplog.text


def test_a_data_limit_beyond_the_data_uses_it_all_and_says_so(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.dataset"):
        ds = build_dataset(make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=5000), "TRAIN")
    assert len(ds) == round(0.8 * 1797)
    assert f"config.DATA.TRAIN.DATA_LIMIT=5000 is more than the {len(ds)} samples of the TRAIN data: using all" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.dataset"):
        build_dataset(make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=100), "TRAIN")
    assert "DATA_LIMIT" not in caplog.text


def test_digits_split_labels_and_images() -> None:
    tr = build_dataset(make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=-1), "TRAIN")
    te = build_dataset(make_cfg("TEST", DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=-1), "TEST")
    assert len(tr) + len(te) == 1797
    assert len(tr) == round(0.8 * 1797)
    assert set(tr.sources[0].indices.tolist()).isdisjoint(te.sources[0].indices.tolist())
    assert set(tr.get_labels().tolist()) == set(range(10))
    img = tr.sources[0].get(0)
    assert img.mode == "RGB" and img.size == (32, 32)
    sample = tr[0]
    assert sample["label"] == [int(tr.get_labels()[0])]
    big = build_dataset(make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=[], DATA_LIMIT=-1, DIGITS_IMAGE_SIZE=24), "TRAIN")
    assert big.sources[0].get(0).size == (24, 24)


def test_digits_are_scikit_learns_read_without_importing_sklearn_datasets() -> None:
    """The bundled file read directly gives load_digits' arrays; importing sklearn.datasets
    (and scipy) would cost each process that builds the data set 1.5 s of CPU."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from ssl_engine.data.sources import _load_digits

    images, targets = _load_digits()
    d = load_digits()
    assert images.dtype == np.float32 and targets.dtype == np.int64
    assert np.array_equal(images, d.images) and np.array_equal(targets, d.target)
    code = ("import sys; from ssl_engine.data.sources import _load_digits; x, y = _load_digits(); "
            "print(len(x), 'sklearn.datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.split() == ["1797", "False"], out.stderr[-2000:]


def test_disk_folder_lengths_labels_and_lazy_open(tmp_path: Any) -> None:
    root = str(tmp_path / "imgs")
    write_image_tree(root, {"cat": 3, "ant": 2, "bee": 1})
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[[root]], LABEL_SOURCES=["disk_folder"],
                   LABEL_PATHS=[root], DATA_LIMIT=-1, TRANSFORMS=[{"name": "ToTensor"}])
    ds = build_dataset(cfg, "TRAIN")
    assert len(ds) == 6
    assert ds.sources[0].classes == ["ant", "bee", "cat"]
    assert ds.get_labels().tolist() == [0, 0, 1, 2, 2, 2]
    sample = ds[(0, 5)]
    assert sample["label"] == [2] and sample["data"][0].shape == (3, 8, 8)
    assert sample["data_idx"] == [5] and sample["data_valid"] == [1]


def test_disk_folder_missing_and_empty_folder_errors(tmp_path: Any) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(UserError, match=r"config\.DATA\.TRAIN\.DATA_PATHS.*nope.*does not exist"):
        build_dataset(make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[missing], LABEL_SOURCES=[]), "TRAIN")
    empty = tmp_path / "empty"
    (empty / "classA").mkdir(parents=True)
    with pytest.raises(UserError, match=r"config\.DATA\.TRAIN\.DATA_PATHS.*empty.*no images"):
        build_dataset(make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(empty)], LABEL_SOURCES=[]), "TRAIN")
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (4, 4)).save(flat / "a.png")
    with pytest.raises(UserError, match="one subfolder per class"):
        build_dataset(make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(flat)], LABEL_SOURCES=[]), "TRAIN")


def test_disk_folder_symlink_loops_are_skipped_and_other_links_followed(tmp_path: Any, caplog: Any) -> None:
    """Symlinks are followed as ImageFolder follows them (a link to another folder lists its images
    there too, under the class that holds the link), but a link back to a folder on its own path
    (the root, or itself) is a loop: skipped with one warning, so the scan ends at once."""
    root = tmp_path / "imgs"
    write_image_tree(str(root), {"a": 3, "b": 2})
    (root / "a" / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(root / "a" / "sub" / "deep.png")
    (root / "b" / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(root / "b" / "sub" / "only.png")
    os.symlink("..", root / "a" / "loop")
    os.symlink("sub", root / "a" / "alias")
    os.symlink("../b/sub", root / "a" / "cross")  # into another class, scanned later under its own path too
    os.symlink(".", root / "b" / "self")
    os.symlink(str(root), root / "b" / "up")
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(root)], LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1)
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.sources"):
        ds = build_dataset(cfg, "TRAIN")
    assert [os.path.relpath(p, root) for p in ds.sources[0].paths] == [
        "a/img0.png", "a/img1.png", "a/img2.png", "a/alias/deep.png", "a/cross/only.png", "a/sub/deep.png",
        "b/img0.png", "b/img1.png", "b/sub/only.png"]
    assert ds.get_labels().tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "config.DATA.TRAIN.DATA_PATHS[0]: skipped 3 symlink(s)" in warnings[0]
    assert f"first {str(root / 'a' / 'loop')!r} -> {str(root)!r}" in warnings[0]


@pytest.mark.parametrize("name", ["gray16.png", "gray16.tif", "gray16be.tif"])
def test_sixteen_bit_grayscale_images_keep_their_high_byte(tmp_path: Any, name: str) -> None:
    """A 16-bit grayscale PNG or TIFF (Pillow's mode I;16) reads as its high byte in R = G = B,
    as Pillow reads a 16-bit RGB PNG; Pillow's convert("RGB") clipped it at 255, so every pixel
    above 255 of 65535 came out white, without a word."""
    values = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257)  # 0 .. 65535
    img = Image.fromarray(values)
    if name.endswith("be.tif"):  # big-endian samples (Pillow's convert("I;16B") would clip them too)
        img = Image.frombytes("I;16B", (16, 16), values.astype(">u2").tobytes())
    (tmp_path / "a").mkdir()
    img.save(tmp_path / "a" / name)
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(tmp_path)], LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1)
    got = np.asarray(build_dataset(cfg, "TRAIN").sources[0].get(0))
    assert got.shape == (16, 16, 3) and got.dtype == np.uint8
    expected = (values >> 8).astype(np.uint8)
    for channel in range(3):
        np.testing.assert_array_equal(got[:, :, channel], expected)


def test_thirty_two_bit_images_whose_values_are_clipped_are_named_in_a_warning_once(tmp_path: Any, caplog: Any,
                                                                                    monkeypatch: Any) -> None:
    """32-bit TIFFs (Pillow modes I and F) convert to RGB by clipping to 0..255, as VISSL read
    them: a float image in 0..1 came out black and integer data above 255 white, without a word.
    The conversion is kept; the first such image of each mode is named with its value range. 8-bit
    values held in a 32-bit image convert exactly and are not named."""
    from ssl_engine.data import sources

    monkeypatch.setattr(sources, "_WIDE_MODES_WARNED", set())
    ramp = np.arange(16 * 16).reshape(16, 16)
    for cls, name, values in (("a", "float01.tif", (ramp / 255.0).astype(np.float32)),
                              ("a", "float01_again.tif", (ramp / 255.0).astype(np.float32)),
                              ("b", "int_wide.tif", (ramp * 1000).astype(np.int32)),
                              ("c", "int_8bit.tif", ramp.astype(np.int32) % 256)):
        (tmp_path / cls).mkdir(exist_ok=True)
        Image.fromarray(values).save(tmp_path / cls / name)
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(tmp_path)], LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1)
    source = build_dataset(cfg, "TRAIN").sources[0]
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.sources"):
        images = [np.asarray(source.get(i)) for i in range(len(source))]
    assert images[0].max() <= 1 and images[2].min() == 0 and images[2][-1, -1, 0] == 255  # Pillow's clipping, kept
    np.testing.assert_array_equal(images[3][:, :, 0], ramp % 256)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"{tmp_path / 'a' / 'float01.tif'} is a 32-bit float image (Pillow mode F) with "
                                  f"values 0..1; it is converted to 8-bit RGB by clipping to 0..255")
    assert warnings[1].startswith(f"{tmp_path / 'b' / 'int_wide.tif'} is a 32-bit integer image (Pillow mode I) with "
                                  f"values 0..255000")


def test_the_thirty_two_bit_image_warning_reaches_the_log_of_a_run(tmp_path: Any) -> None:
    """The pre-launch checks read a batch with logging silenced; the warning they could not show is
    shown by the run's own reads. Was: the checks marked the mode as warned of, and no run through
    the tool ever logged it."""
    from conftest import run_tool

    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((32, 32), 0.5, dtype=np.float32)).save(tmp_path / "data" / cls / f"{i}.tif")
    data = [f"config.DATA.TRAIN.{key}" for key in ("DATA_SOURCES=[disk_folder]", "LABEL_SOURCES=[disk_folder]",
                                                   f"DATA_PATHS=[{tmp_path / 'data'}]", "BATCHSIZE_PER_REPLICA=2")]
    r = run_tool(["config=quick/supervised_digits", *data, "config.TEST_MODEL=false", "config.OPTIMIZER.num_epochs=1",
                  "config.MODEL.TRUNK.NAME=mlp", "config.MODEL.TRUNK.MLP.DIMS=[3072,8]",
                  "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[8,10]}]]", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    log_text = (tmp_path / "run" / "log.txt").read_text()
    assert log_text.count("is a 32-bit float image (Pillow mode F) with values 0.5..0.5") == 1, log_text[-3000:]


def test_disk_folder_class_links_that_loop_are_skipped_like_dangling_ones(tmp_path: Any, caplog: Any) -> None:
    """A link in the top folder that cannot be followed (``c -> c``, or ``d -> e -> d``: ELOOP) is
    no class, as a dangling link is none, and is named in the loop warning; os.scandir's is_dir
    raised OSError for it, a traceback and exit 1 from the tool."""
    root = tmp_path / "imgs"
    write_image_tree(str(root), {"a": 2, "b": 1})
    os.symlink("c", root / "c")
    os.symlink("e", root / "d")
    os.symlink("d", root / "e")
    os.symlink("nowhere", root / "f")  # dangling: no class, no warning (as before)
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(root)], LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1)
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.sources"):
        ds = build_dataset(cfg, "TRAIN")
    assert ds.sources[0].classes == ["a", "b"]
    assert ds.get_labels().tolist() == [0, 0, 1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "config.DATA.TRAIN.DATA_PATHS[0]: skipped 3 symlink(s)" in warnings[0], warnings
    assert f"first {str(root / 'c')!r}" in warnings[0]


def test_disk_folder_class_folders_that_are_one_folder_are_named_in_a_warning(tmp_path: Any, caplog: Any) -> None:
    """A class folder that is a link to another class folder reads its images under both labels
    (as ImageFolder does): a warning names the classes, which was silent."""
    root = tmp_path / "imgs"
    write_image_tree(str(root), {"a": 2, "b": 1})
    os.symlink("a", root / "z")
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(root)], LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1)
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.sources"):
        ds = build_dataset(cfg, "TRAIN")
    assert ds.get_labels().tolist() == [0, 0, 1, 2, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["config.DATA.TRAIN.DATA_PATHS[0]: class folders 'a', 'z' are one folder (symlinks): its images "
                        "are read once under each of these classes, as torchvision's ImageFolder reads them"], warnings


def test_disk_folder_empty_class_folders_are_a_user_error(tmp_path: Any) -> None:
    """As in torchvision's ImageFolder: an empty class folder would still take a label id."""
    root = tmp_path / "imgs"
    write_image_tree(str(root), {"a": 2, "b": 2})
    (root / "zz_empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("no images here\n")
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(root)], LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1)
    with pytest.raises(UserError, match=r"config\.DATA\.TRAIN\.DATA_PATHS\[0\]: 2 class folder\(s\) of '.*imgs' hold no "
                                        r"images: 'notes', 'zz_empty'; each subfolder is a class: put images in them "
                                        r".*removing one renumbers the classes after it"):
        build_dataset(cfg, "TRAIN")
    for i in range(7):
        (root / f"e{i}").mkdir()
    with pytest.raises(UserError, match=r"9 class folder\(s\) .* 'e0', 'e1', 'e2', 'e3', 'e4' and 4 more;"):
        build_dataset(cfg, "TRAIN")


def test_disk_filelist_npy_and_txt_with_labels(tmp_path: Any) -> None:
    root = str(tmp_path / "imgs")
    write_image_tree(root, {"a": 2, "b": 2})
    paths = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs)
    npy = str(tmp_path / "files.npy")
    np.save(npy, np.array(paths, dtype=str))
    txt = str(tmp_path / "files.txt")
    with open(txt, "w") as f:
        f.write("\n".join(paths) + "\n")
    lab = str(tmp_path / "labels.npy")
    np.save(lab, np.array([3, 1, 4, 1]))
    for lst in (npy, txt):
        cfg = make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[lst], LABEL_SOURCES=["disk_filelist"],
                       LABEL_PATHS=[lab], DATA_LIMIT=-1, TRANSFORMS=[{"name": "ToTensor"}])
        ds = build_dataset(cfg, "TRAIN")
        assert len(ds) == 4
        assert [ds[i]["label"][0] for i in range(4)] == [3, 1, 4, 1]
    for upper in ("FILES.NPY", "FILES.TXT"):  # the extension in capitals is the same file type
        src = npy if upper.endswith("NPY") else txt
        os.rename(src, str(tmp_path / upper))
        cfg = make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[str(tmp_path / upper)],
                       LABEL_SOURCES=["disk_filelist"], LABEL_PATHS=[lab], DATA_LIMIT=-1,
                       TRANSFORMS=[{"name": "ToTensor"}])
        assert [build_dataset(cfg, "TRAIN")[i]["label"][0] for i in range(4)] == [3, 1, 4, 1]
        os.rename(str(tmp_path / upper), src)
    bad = str(tmp_path / "short.npy")
    np.save(bad, np.array([0, 1, 2]))
    cfg = make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[npy], LABEL_SOURCES=["disk_filelist"],
                   LABEL_PATHS=[bad], DATA_LIMIT=-1)
    with pytest.raises(UserError, match=r"LABEL_PATHS\[0\].*has 3 labels.*has 4 samples"):
        build_dataset(cfg, "TRAIN")


def _filelist_cfg(tmp_path: Any, labels: Any = None, n: int = 4, **keys: Any) -> AttrDict:
    """A disk_filelist config over ``n`` images (a .npy list), with LABEL_PATHS from ``labels``
    (an array saved as .npy, or a str that is the label file's path)."""
    root = str(tmp_path / "imgs")
    write_image_tree(root, {"a": (n + 1) // 2, "b": n // 2})
    paths = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs)
    lst = str(tmp_path / "files.npy")
    np.save(lst, np.array(paths, dtype=str))
    split_keys: Dict[str, Any] = {"DATA_SOURCES": ["disk_filelist"], "DATA_PATHS": [lst], "LABEL_SOURCES": [],
                                  "DATA_LIMIT": -1}
    if labels is not None:
        lab = labels if isinstance(labels, str) else str(tmp_path / "labels.npy")
        if not isinstance(labels, str):
            np.save(lab, labels)
        split_keys.update(LABEL_SOURCES=["disk_filelist"], LABEL_PATHS=[lab])
    split_keys.update(keys)
    return make_cfg(**split_keys)


@pytest.mark.parametrize("collator", ["default_collate", "simclr_collator"])
def test_a_split_without_to_tensor_names_its_own_transforms_key(collator: str) -> None:
    """The collators are shared by the splits and said config.DATA.<split>.TRANSFORMS literally:
    the loader's collator names the split it batches."""
    for split in ("TEST", "TRAIN"):
        cfg = make_cfg(split=split, COLLATE_FUNCTION=collator,
                       TRANSFORMS=[{"name": "ImgReplicatePil", "num_times": 2}] if collator == "simclr_collator" else [])
        loader = build_dataloader(build_dataset(cfg, split), cfg, split, rank=0, world_size=1, device="cpu")
        with pytest.raises(UserError, match=rf"not a tensor; end config\.DATA\.{split}\.TRANSFORMS with ToTensor"):
            next(iter(loader))


def test_filelist_integer_valued_float_labels_are_int_class_indices(tmp_path: Any) -> None:
    ds = build_dataset(_filelist_cfg(tmp_path, np.array([0.0, 3.0, 1.0, 2.0])), "TRAIN")
    labels = ds.get_labels()
    assert labels.dtype == np.int64 and labels.tolist() == [0, 3, 1, 2]
    txt = tmp_path / "labels.txt"
    txt.write_text("1.0\n2\n 0 \n3.0\n")
    assert build_dataset(_filelist_cfg(tmp_path, str(txt)), "TRAIN").get_labels().tolist() == [1, 2, 0, 3]


@pytest.mark.parametrize("labels, shown", [
    ([0.0, 0.5, 1.0, 1.7], "0.5 at index 1"),
    ([np.nan, 1.0, 1.0, 0.0], "nan at index 0"),
    ([0.0, 1.0, np.inf, 0.0], "inf at index 2"),
    ([0.0, 1.0, 2.0, 1e300], "1e+300 at index 3"),
])
def test_filelist_fractional_or_non_finite_labels_are_a_user_error(tmp_path: Any, labels: List[float], shown: str) -> None:
    """A cast would silently make 0.5 class 0 and NaN a huge negative class."""
    with pytest.raises(UserError, match=r"config\.DATA\.TRAIN\.LABEL_PATHS\[0\]: '.*labels\.npy' holds the label "
                                        + re.escape(shown) + ".*integer class indices"):
        build_dataset(_filelist_cfg(tmp_path, np.array(labels)), "TRAIN")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_filelist_half_and_single_precision_labels_read_without_a_warning(tmp_path: Any, dtype: Any) -> None:
    """float16 labels are read as ints with no "overflow encountered in cast" RuntimeWarning on the
    console (2**53, the bound the labels are checked against, overflowed float16)."""
    import warnings

    cfg = _filelist_cfg(tmp_path, labels=np.array([0, 1, 2, 3], dtype=dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = build_dataset(cfg, "TRAIN")
    assert ds.get_labels().tolist() == [0, 1, 2, 3] and ds.get_labels().dtype == np.int64


def test_filelist_uint64_labels_read_as_classes_and_one_beyond_int64_is_named(tmp_path: Any) -> None:
    ok = build_dataset(_filelist_cfg(tmp_path, np.array([0, 3, 1, 2], dtype=np.uint64)), "TRAIN")
    assert ok.get_labels().dtype == np.int64 and ok.get_labels().tolist() == [0, 3, 1, 2]
    huge = np.array([0, 1, 2**63 + 1, 2], dtype=np.uint64)  # a cast would make it class -2**63 + 1
    with pytest.raises(UserError, match=r"LABEL_PATHS\[0\]: '.*labels\.npy' holds the label 9223372036854775809 at index 2"):
        build_dataset(_filelist_cfg(tmp_path, huge), "TRAIN")


def test_filelist_text_label_that_is_not_a_number_is_a_user_error(tmp_path: Any) -> None:
    txt = tmp_path / "labels.txt"
    txt.write_text("1\n2\ncat\n0\n")
    with pytest.raises(UserError, match=r"LABEL_PATHS\[0\]: '.*labels\.txt' holds 'cat' at index 2, not a number"):
        build_dataset(_filelist_cfg(tmp_path, str(txt)), "TRAIN")


@pytest.mark.parametrize("name", ["list.npy", "list.txt"])
def test_filelist_empty_file_is_a_user_error(tmp_path: Any, name: str) -> None:
    """A 0-byte list (an interrupted copy): numpy's EOFError would be a traceback."""
    empty = tmp_path / name
    empty.write_bytes(b"")
    with pytest.raises(UserError, match=r"DATA_PATHS\[0\]: '.*list\.(npy|txt)' is empty \(0 bytes\); expected a "
                                        r"\.npy array of image paths or a \.txt list, one per line"):
        build_dataset(make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[str(empty)], LABEL_SOURCES=[]), "TRAIN")
    with pytest.raises(UserError, match=r"LABEL_PATHS\[0\]: '.*list\.(npy|txt)' is empty \(0 bytes\); expected a "
                                        r"\.npy array of integer labels"):
        build_dataset(_filelist_cfg(tmp_path, str(empty)), "TRAIN")


def test_filelist_txt_with_non_utf8_names_reads_the_files_on_disk(tmp_path: Any) -> None:
    """File names on Linux are bytes: a latin-1 .txt list names latin-1 files that exist."""
    folder = os.fsencode(str(tmp_path))
    names = [folder + b"/caf\xe9.png", folder + b"/na\xefve.png", folder + b"/plain.png"]
    for i, name in enumerate(names):
        with open(name, "wb") as f:
            Image.new("RGB", (4, 4), (i * 50, 0, 0)).save(f, format="PNG")
    txt = tmp_path / "files.txt"
    txt.write_bytes(b"\n".join(names) + b"\n")
    ds = build_dataset(make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[str(txt)], LABEL_SOURCES=[],
                                DATA_LIMIT=-1), "TRAIN")
    assert len(ds) == 3
    assert [ds.sources[0].get(i).getpixel((0, 0))[0] for i in range(3)] == [0, 50, 100]


def test_filelist_txt_not_utf8_whose_names_do_not_exist_names_the_byte(tmp_path: Any) -> None:
    txt = tmp_path / "files.txt"
    txt.write_bytes(b"/nowhere/caf\xe9.png\n")
    with pytest.raises(UserError, match=r"DATA_PATHS\[0\]: the first image listed in '.*files\.txt', "
                                        r"'/nowhere/caf\\udce9\.png', does not exist \(the name is not UTF-8: byte "
                                        r"0xe9 at offset 12;"):
        build_dataset(make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[str(txt)], LABEL_SOURCES=[]), "TRAIN")
    labels = tmp_path / "labels.txt"
    labels.write_bytes(b"0\n1\n\xe9\n1\n")
    with pytest.raises(UserError, match=r"LABEL_PATHS\[0\]: '.*labels\.txt' holds '\\udce9' at index 2, not a number"):
        build_dataset(_filelist_cfg(tmp_path, str(labels)), "TRAIN")


def _list_and_labels_cfg(data: str, labels: str) -> AttrDict:
    return make_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[data], LABEL_SOURCES=["disk_filelist"],
                    LABEL_PATHS=[labels], DATA_LIMIT=-1)


def test_filelist_path_that_is_a_pipe_a_device_or_a_bad_link_says_which(tmp_path: Any) -> None:
    """A list or label path that exists but is no regular file (a named pipe, /dev/null), or a
    symlink that loops or leads nowhere, is named as such; each was "file ... does not exist"."""
    write_image_tree(str(tmp_path / "imgs"), {"a": 2})
    images = [str(tmp_path / "imgs" / "a" / f"img{i}.png") for i in range(2)]
    np.save(tmp_path / "images.npy", np.array(images))
    np.save(tmp_path / "labels.npy", np.array([0, 1]))
    os.mkfifo(tmp_path / "pipe.npy")
    os.symlink("loop.npy", tmp_path / "loop.npy")
    os.symlink(str(tmp_path / "gone.npy"), tmp_path / "dangling.npy")
    cases = [
        (str(tmp_path / "pipe.npy"), str(tmp_path / "labels.npy"),
         f"config.DATA.TRAIN.DATA_PATHS[0]: {str(tmp_path / 'pipe.npy')!r} is not a regular file"),
        ("/dev/null", str(tmp_path / "labels.npy"), "config.DATA.TRAIN.DATA_PATHS[0]: '/dev/null' is not a regular file"),
        (str(tmp_path / "images.npy"), str(tmp_path / "loop.npy"),
         f"config.DATA.TRAIN.LABEL_PATHS[0]: file {str(tmp_path / 'loop.npy')!r} is a symlink loop"),
        (str(tmp_path / "images.npy"), str(tmp_path / "dangling.npy"),
         f"config.DATA.TRAIN.LABEL_PATHS[0]: file {str(tmp_path / 'dangling.npy')!r} is a symlink to "
         f"{str(tmp_path / 'gone.npy')!r}, which does not exist"),
    ]
    for data, labels, message in cases:
        with pytest.raises(UserError) as info:
            build_dataset(_list_and_labels_cfg(data, labels), "TRAIN")
        assert message in str(info.value), str(info.value)
    os.symlink("folder_loop", tmp_path / "folder_loop")
    with pytest.raises(UserError, match="folder .*folder_loop' is a symlink loop"):
        build_dataset(make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(tmp_path / "folder_loop")],
                               LABEL_SOURCES=["disk_folder"], DATA_LIMIT=-1), "TRAIN")


def test_a_named_pipe_as_the_file_list_is_one_line_through_the_tool(tmp_path: Any) -> None:
    """Through the tool (whose config check sees that the path exists): exit 2, one line saying
    the pipe is not a regular file, instead of one saying that it does not exist."""
    from conftest import run_tool

    os.mkfifo(tmp_path / "pipe.npy")
    proc = run_tool(["config=quick/supervised_digits", "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false",
                     "config.MODEL.TRUNK.NAME=mlp", "config.MODEL.TRUNK.MLP.DIMS=[3072,16]",
                     "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}]]", "config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                     "config.DATA.TRAIN.LABEL_SOURCES=[]", f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'pipe.npy'}]",
                     f"config.CHECKPOINT.DIR={tmp_path / 'run'}"], timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert f"{str(tmp_path / 'pipe.npy')!r} is not a regular file" in err, err


def test_filelist_path_that_is_a_folder_says_so(tmp_path: Any) -> None:
    cfg = _filelist_cfg(tmp_path, str(tmp_path / "imgs"))
    with pytest.raises(UserError, match=r"LABEL_PATHS\[0\]: '.*imgs' is a folder; the disk_filelist label source "
                                        r"expects a \.npy or \.txt file listing integer labels.*disk_folder source in "
                                        r"config\.DATA\.TRAIN\.LABEL_SOURCES"):
        build_dataset(cfg, "TRAIN")
    cfg.DATA.TRAIN.DATA_PATHS = [str(tmp_path / "imgs")]
    with pytest.raises(UserError, match=r"DATA_PATHS\[0\]: '.*imgs' is a folder; disk_filelist expects a \.npy or "
                                        r"\.txt file listing image paths.*config\.DATA\.TRAIN\.DATA_SOURCES"):
        build_dataset(cfg, "TRAIN")


@pytest.mark.parametrize("mmap", [True, False])
def test_filelist_truncated_or_foreign_npy_says_what_is_wrong(tmp_path: Any, mmap: bool) -> None:
    cfg = _filelist_cfg(tmp_path, MMAP_MODE=mmap)
    lst = cfg.DATA.TRAIN.DATA_PATHS[0]
    whole = open(lst, "rb").read()
    for damage, message in [
        (whole[: len(whole) - 40], r"is truncated or corrupt: its header says shape \(4,\) of <U\d+ \(\d+ bytes with "
                                   r"the header\) but the file has \d+ bytes"),
        (whole[:20], r"has a truncated or corrupt NumPy header"),
        (b"just some text\n", r"is not a \.npy file \(no NumPy header\)"),
        (b"\x80\x04\x95 pickled", r"holds pickled Python data, which is never loaded"),
    ]:
        with open(lst, "wb") as f:
            f.write(damage)
        with pytest.raises(UserError, match=r"DATA_PATHS\[0\]: '.*files\.npy' " + message):
            build_dataset(cfg, "TRAIN")
    np.save(lst, np.array([object(), 1], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match=r"holds Python objects, which load only with pickle"):
        build_dataset(cfg, "TRAIN")
    with open(lst, "wb") as f:  # np.savez under a .npy name: np.load gives an archive, not an array
        np.savez(f, paths=np.array([str(tmp_path / "a.png")]))
    with pytest.raises(UserError, match=r"files\.npy' is a \.npz archive of arrays \(np\.savez\), not one \.npy array"):
        build_dataset(cfg, "TRAIN")


@pytest.mark.parametrize("mmap", [True, False])
def test_filelist_of_bytes_names_the_files(tmp_path: Any, mmap: bool) -> None:
    """np.array([p.encode() ...]) (dtype 'S') holds names as bytes: they are decoded, not shown as "b'/path'"."""
    cfg = _filelist_cfg(tmp_path, MMAP_MODE=mmap)
    lst = cfg.DATA.TRAIN.DATA_PATHS[0]
    paths = [str(p) for p in np.load(lst)]
    np.save(lst, np.array([os.fsencode(p) for p in paths]))
    ds = build_dataset(cfg, "TRAIN")
    assert [ds.sources[0].path(i) for i in range(len(ds))] == paths
    assert ds.sources[0].get(3).size == (8, 8)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_loader_refuses_more_workers_than_its_machine_can_start(monkeypatch: Any) -> None:
    """100000 workers would hang starting them: the rank that builds the loader refuses more than
    max(64, 8 x its CPUs); the check before launch (check_cpus=False) leaves that to the rank."""
    ds = build_dataset(make_cfg(DATA_LIMIT=8), "TRAIN")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(UserError, match=r"^config\.DATA\.NUM_DATALOADER_WORKERS=65 is more loader workers per rank "
                                        r"than this machine \(2 CPUs\) can start: at most 64"):
        build_dataloader(ds, make_cfg(workers=65), "TRAIN", rank=0, world_size=1, device="cpu")
    build_dataloader(ds, make_cfg(workers=65), "TRAIN", rank=0, world_size=1, device="cpu", check_cpus=False)
    build_dataloader(ds, make_cfg(workers=64), "TRAIN", rank=0, world_size=1, device="cpu")
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    build_dataloader(ds, make_cfg(workers=256), "TRAIN", rank=0, world_size=1, device="cpu")
    with pytest.raises(UserError, match=r"=257 .*\(32 CPUs\) can start: at most 256"):
        build_dataloader(ds, make_cfg(workers=257), "TRAIN", rank=0, world_size=1, device="cpu")


def test_config_errors_for_sources() -> None:
    with pytest.raises(UserError, match=r"config\.DATA\.TRAIN\.DATA_SOURCES is empty"):
        build_dataset(make_cfg(DATA_SOURCES=[]), "TRAIN")
    with pytest.raises(UserError, match=r"unknown data source 'synthetik'.*synthetic"):
        build_dataset(make_cfg(DATA_SOURCES=["synthetik"]), "TRAIN")
    with pytest.raises(UserError, match="LABEL_TYPE"):
        build_dataset(make_cfg(LABEL_TYPE="nope"), "TRAIN")
    with pytest.raises(UserError, match="ON_CORRUPT_IMAGE"):
        build_dataset(make_cfg(ON_CORRUPT_IMAGE="ignore"), "TRAIN")
    with pytest.raises(UserError, match=r"config\.DATA\.TEST is missing"):
        build_dataset(make_cfg("TRAIN"), "TEST")


def test_two_data_sources_and_label_source_errors() -> None:
    cfg = make_cfg(DATA_SOURCES=["synthetic", "synthetic"], LABEL_SOURCES=["synthetic"],
                   TRANSFORMS=[{"name": "ToTensor"}])
    ds = build_dataset(cfg, "TRAIN")
    s = ds[(0, 4)]
    assert len(s["data"]) == 2 and len(s["label"]) == 1 and s["data_idx"] == [4, 4]
    batch = default_collate([ds[(0, i)] for i in range(3)])
    assert len(batch["data"]) == 2 and batch["data"][1].shape == (3, 3, 16, 16)
    with pytest.raises(UserError, match=r"same length.*synthetic=1000.*digits=1438"):
        build_dataset(make_cfg(DATA_SOURCES=["synthetic", "digits"], LABEL_SOURCES=[], DATA_LIMIT=-1), "TRAIN")
    with pytest.raises(UserError, match=r"LABEL_SOURCES\[0\].*unknown label source 'digit'.*digits"):
        build_dataset(make_cfg(LABEL_SOURCES=["digit"]), "TRAIN")
    with pytest.raises(UserError, match=r"LABEL_SOURCES\[0\].*has 1438 labels.*40 samples"):
        build_dataset(make_cfg(LABEL_SOURCES=["digits"]), "TRAIN")


def test_label_types_and_data_limit_subset() -> None:
    cfg = make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=[], LABEL_TYPE="sample_index", DATA_LIMIT=50)
    ds = build_dataset(cfg, "TRAIN")
    assert len(ds) == 50
    assert ds[7]["label"] == [7] and ds[7]["data_idx"] == [7]
    again = build_dataset(cfg, "TRAIN")
    assert np.array_equal(ds.subset, again.subset) and np.all(np.diff(ds.subset) > 0)
    cfg.DATA.TRAIN.DATA_LIMIT_SAMPLING = {"SEED": 5}
    assert not np.array_equal(build_dataset(cfg, "TRAIN").subset, ds.subset)
    zero = build_dataset(make_cfg(LABEL_TYPE="zero", LABEL_SOURCES=[]), "TRAIN")
    assert zero[3]["label"] == [0]
    bal = build_dataset(
        make_cfg(DATA_SOURCES=["digits"], LABEL_SOURCES=["digits"], DATA_LIMIT=30,
                 DATA_LIMIT_SAMPLING={"SEED": 0, "IS_BALANCED": True}), "TRAIN")
    assert np.bincount(bal.get_labels()).tolist() == [3] * 10


# ----------------------------------------------------------------------------- transforms


def test_transforms_by_name_and_vissl_transforms() -> None:
    img = Image.new("RGB", (20, 20), (200, 30, 30))
    for spec, check in [
        ({"name": "Resize", "size": 10, "interpolation": "bicubic"}, lambda o: o.size == (10, 10)),
        ({"name": "Resize", "size": 10, "interpolation": 3}, lambda o: o.size == (10, 10)),  # VISSL's tricks_384
        ({"name": "CenterCrop", "size": 8}, lambda o: o.size == (8, 8)),
        ({"name": "ToTensor"}, lambda o: o.shape == (3, 20, 20)),
        ({"name": "ImgReplicatePil", "num_times": 3}, lambda o: isinstance(o, list) and len(o) == 3),
        ({"name": "ImgPilColorDistortion", "strength": 0.5}, lambda o: o.size == (20, 20)),
        ({"name": "RandomApply", "transforms": [{"name": "Grayscale", "num_output_channels": 3}], "p": 1.0},
         lambda o: np.asarray(o)[..., 0].tolist() == np.asarray(o)[..., 1].tolist()),
    ]:
        name, t, _ = build_transform(spec)
        assert name == spec["name"] and check(t(img)), spec
    noisy = Image.fromarray(np.random.RandomState(0).randint(0, 255, (20, 20, 3)).astype(np.uint8))
    _, blur, _ = build_transform({"name": "ImgPilGaussianBlur", "p": 1.0, "radius_min": 1.0, "radius_max": 2.0})
    assert np.asarray(blur(noisy)).std() < np.asarray(noisy).std()
    _, noblur, _ = build_transform({"name": "ImgPilGaussianBlur", "p": 0.0, "radius_min": 1.0, "radius_max": 2.0})
    assert noblur(noisy) is noisy
    _, mc, _ = build_transform({"name": "ImgPilToMultiCrop", "total_num_crops": 5, "num_crops": [2, 3],
                                "size_crops": [16, 8], "crop_scales": [[0.5, 1.0], [0.1, 0.5]]})
    assert [v.size for v in mc(img)] == [(16, 16)] * 2 + [(8, 8)] * 3


def test_interpolation_as_a_pillow_code_is_torchvision_mode_of_that_name() -> None:
    """VISSL's configs write Pillow's filter codes (interpolation: 3); a code torchvision has
    no mode for is one line naming the entry, not torchvision's bare KeyError."""
    _, t, _ = build_transform({"name": "RandomResizedCrop", "size": 8, "interpolation": 3})
    assert t.interpolation == T.InterpolationMode.BICUBIC
    _, t, _ = build_transform({"name": "Resize", "size": 8, "interpolation": 1})
    assert t.interpolation == T.InterpolationMode.LANCZOS
    for bad in (9, -1, 7):  # 7 is Pillow's MKS2021 where Pillow has it, which torchvision lacks
        with pytest.raises(UserError, match=rf"TRANSFORMS\[0\]: unknown interpolation {bad}; valid: .*3 \(bicubic\)"):
            build_transform({"name": "Resize", "size": 8, "interpolation": bad}, "config.DATA.TRAIN.TRANSFORMS[0]")


def test_img_rotate_pil_rotates_by_a_drawn_quarter_turn_and_makes_it_the_label() -> None:
    """RotNet's pretext: the label says which of num_angles rotations the image got, replacing
    the data set's label; untouched entries keep theirs."""
    img = Image.fromarray(np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3))  # no rotation leaves it as it is
    wrapper = SSLTransformsWrapper([{"name": "ImgRotatePil"}])
    seen = set()
    for seed in range(40):
        torch.manual_seed(seed)
        out = wrapper({"data": [img], "label": [7], "data_valid": [1], "data_idx": [seed]})
        (rotated,), (k,) = out["data"], out["label"]
        assert np.array_equal(np.asarray(rotated), np.rot90(np.asarray(img), k)), k  # k quarter turns, counter-clockwise
        seen.add(k)
    assert seen == {0, 1, 2, 3}
    two = SSLTransformsWrapper([{"name": "ImgRotatePil", "num_angles": 2, "indices": [1]}])
    out = two({"data": [img, img], "label": [5, 6], "data_valid": [1, 1], "data_idx": [0, 0]})
    assert out["data"][0] is img and out["label"][0] == 5 and out["label"][1] in (0, 1)
    unlabelled = wrapper({"data": [img], "label": [], "data_valid": [1], "data_idx": [0]})  # no LABEL_SOURCES
    assert unlabelled["label"][0] in (0, 1, 2, 3)
    with pytest.raises(UserError, match=r"num_rotations_per_img=4: only 1 is supported"):
        build_transform({"name": "ImgRotatePil", "num_rotations_per_img": 4})


def test_transform_errors_are_user_errors() -> None:
    with pytest.raises(UserError, match=r"TRANSFORMS\[0\].*unknown transform 'RandomResizeCrop'.*RandomResizedCrop"):
        SSLTransformsWrapper([{"name": "RandomResizeCrop", "size": 4}], "config.DATA.TRAIN.TRANSFORMS")
    with pytest.raises(UserError, match=r"TRANSFORMS\[1\].*'Resize'.*unexpected keyword argument 'sise'"):
        SSLTransformsWrapper([{"name": "ToTensor"}, {"name": "Resize", "sise": 4}], "config.DATA.TRAIN.TRANSFORMS")
    with pytest.raises(UserError, match="ImgPilToMultiCrop.*total_num_crops"):
        build_transform({"name": "ImgPilToMultiCrop", "total_num_crops": 4, "num_crops": [2, 3],
                         "size_crops": [16, 8], "crop_scales": [[0.5, 1.0], [0.1, 0.5]]})
    for key, value in (("size_crops", [16.5, 8]), ("num_crops", [2, 1.5])):  # was cut to 16 / 1 without a word
        spec = {"name": "ImgPilToMultiCrop", "total_num_crops": 3, "num_crops": [2, 1], "size_crops": [16, 8],
                "crop_scales": [[0.5, 1.0], [0.1, 0.5]], key: value}
        with pytest.raises(UserError, match=rf"ImgPilToMultiCrop.*{key}\[\d\]=1\d?\.5 must be a whole number"):
            build_transform(spec)
    with pytest.raises(UserError, match="'name'"):
        build_transform({"size": 3})
    # a flat crop_scales (one group's pair without its brackets) or a bare number for a group list
    for key, value, said in (("crop_scales", [0.5, 1.0], r"crop_scales\[0\]=0\.5 must be a pair of numbers \[min, max\]"),
                             ("crop_scales", [["a", 1]], r"crop_scales\[0\]=\['a', 1\] must be a pair"),
                             ("num_crops", 3, r"num_crops=3 must be a list with one entry per group of crops"),
                             ("size_crops", 16, r"size_crops=16 must be a list with one entry per group")):
        spec = {"name": "ImgPilToMultiCrop", "total_num_crops": 3, "num_crops": [3], "size_crops": [16],
                "crop_scales": [[0.5, 1.0]], key: value}
        with pytest.raises(UserError, match=r"ImgPilToMultiCrop.*" + said):
            build_transform(spec)
    ds = build_dataset(make_cfg(TRANSFORMS=[{"name": "Normalize", "mean": [0.5] * 3, "std": [0.5] * 3}]), "TRAIN")
    with pytest.raises(UserError, match=r"TRANSFORMS\[0\] \(Normalize with mean=\[0.5, 0.5, 0.5\], std=\[0.5, 0.5, 0.5\]\) "
                                        r"failed"):
        ds[0]
    ds = build_dataset(make_cfg(TRANSFORMS=[{"name": "ToTensor"}, {"name": "ImgPilGaussianBlur"}]), "TRAIN")
    with pytest.raises(UserError, match=r"TRANSFORMS\[1\] \(ImgPilGaussianBlur\).*before ToTensor"):
        ds[0]
    # values that fail only on an image (Normalize's mean against the channels: a RuntimeError
    # inside torch) or in the constructor (a one-value RandomResizedCrop scale: an IndexError)
    ds = build_dataset(make_cfg(TRANSFORMS=[{"name": "ToTensor"}, {"name": "Normalize", "mean": [0.5] * 2,
                                                                   "std": [0.5] * 3}]), "TRAIN")
    # the message gives the entry's settings as given: the value to fix is on the line
    with pytest.raises(UserError, match=r"TRANSFORMS\[1\] \(Normalize with mean=\[0.5, 0.5\], std=\[0.5, 0.5, 0.5\]\) "
                                        r"failed on data entry 0.*size of tensor.*; check its settings$"):
        ds[0]
    with pytest.raises(UserError, match=r"TRANSFORMS\[0\].*RandomResizedCrop"):
        SSLTransformsWrapper([{"name": "RandomResizedCrop", "size": 4, "scale": [0.5]}], "config.DATA.TRAIN.TRANSFORMS")
    ds = build_dataset(make_cfg(TRANSFORMS=[{"name": "RandomHorizontalFlip", "p": "abc"}]), "TRAIN")
    with pytest.raises(UserError, match=r"TRANSFORMS\[0\] \(RandomHorizontalFlip with p='abc'\) failed on data entry 0"):
        ds[0]


def test_replicate_then_indices_and_label_replication() -> None:
    specs = [
        {"name": "ImgReplicatePil", "num_times": 2},
        {"name": "ImgPilGaussianBlur", "indices": [0], "p": 1.0, "radius_min": 3.0, "radius_max": 3.0},
        {"name": "ToTensor"},
    ]
    ds = build_dataset(make_cfg(TRANSFORMS=specs, SYNTHETIC_IMAGE_SIZE=16), "TRAIN")
    s = ds[(0, 2)]
    assert len(s["data"]) == 2
    assert s["label"] == [s["label"][0]] * 2 and s["data_idx"] == [2, 2] and s["data_valid"] == [1, 1]
    assert s["data"][0].std() < s["data"][1].std()  # only view 0 blurred
    with pytest.raises(UserError, match="index 5 in 'indices' is out of range"):
        build_dataset(make_cfg(TRANSFORMS=[{"name": "ToTensor", "indices": [5]}]), "TRAIN")[0]


@pytest.mark.parametrize("name", ["ImgPil2RGB", "MaskedImageModeling", "MultiLabelTransform", "TensorToImgPil"])
def test_vissls_later_transforms_are_named_as_vissls_not_as_a_near_implemented_name(name: str) -> None:
    with pytest.raises(UserError, match=rf"transform '{name}'.* is one of VISSL's that ssl_engine does not implement") as exc:
        SSLTransformsWrapper([{"name": name}], "config.DATA.TRAIN.TRANSFORMS")
    assert "did you mean" not in str(exc.value)

def test_empty_indices_apply_to_every_entry_as_in_vissl() -> None:
    """VISSL reads ``indices: []`` (its default for the key) as every data entry, not as none."""
    specs = [{"name": "ImgReplicatePil", "num_times": 2}, {"name": "ToTensor", "indices": []}]
    s = build_dataset(make_cfg(TRANSFORMS=specs, SYNTHETIC_IMAGE_SIZE=8), "TRAIN")[(0, 1)]
    assert [type(v) for v in s["data"]] == [torch.Tensor, torch.Tensor]
    rot = [{"name": "ImgRotatePil", "indices": []}]
    assert labelling_transform(rot, every_entry=True) == "ImgRotatePil"
    assert SSLTransformsWrapper(rot).label_setters() == (3, True)


# ----------------------------------------------------------------------------- seeded augmentation


def test_same_seed_epoch_idx_gives_identical_tensors_and_epochs_differ() -> None:
    a = build_dataset(make_cfg(TRANSFORMS=SIMCLR_AUG), "TRAIN")
    b = build_dataset(make_cfg(TRANSFORMS=SIMCLR_AUG), "TRAIN")
    for key in [(0, 3), (4, 3), (1, 17)]:
        assert tensors_equal(a[key]["data"], b[key]["data"])
    assert tensors_equal(a[(2, 5)]["data"], a[(2, 5)]["data"])  # order of calls does not matter
    assert not tensors_equal(a[(0, 3)]["data"], a[(1, 3)]["data"])
    v0, v1 = a[(0, 3)]["data"]
    assert not torch.equal(v0, v1)  # the two views are different augmentations
    a.set_epoch(4)
    assert tensors_equal(a[3]["data"], b[(4, 3)]["data"])
    c = build_dataset(make_cfg(seed=1, TRANSFORMS=SIMCLR_AUG), "TRAIN")
    assert not tensors_equal(c[(0, 3)]["data"], a[(0, 3)]["data"])


def test_getitem_leaves_global_rngs_untouched() -> None:
    specs = SIMCLR_AUG[:-1] + [{"name": "ImgPilGaussianBlur", "p": 0.5}, {"name": "ToTensor"}]
    ds = build_dataset(make_cfg(TRANSFORMS=specs), "TRAIN")
    torch.manual_seed(123)
    random.seed(7)
    np.random.seed(9)
    t_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    for i in range(5):
        ds[(1, i)]
    assert torch.equal(torch.get_rng_state(), t_state)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]


def _epoch_batches(workers: int, epochs: List[int]) -> Dict[int, List[Dict[str, Any]]]:
    cfg = make_cfg(workers=workers, DATA_LIMIT=24, BATCHSIZE_PER_REPLICA=4, TRANSFORMS=SIMCLR_AUG,
                   COLLATE_FUNCTION="simclr_collator")
    loader = build_dataloader(build_dataset(cfg, "TRAIN"), cfg, "TRAIN", rank=0, world_size=1, device="cpu")
    out = {}
    for e in epochs:
        set_loader_position(loader, e, 0)
        out[e] = list(iter(loader))
    return out


def test_zero_and_two_workers_give_identical_batches() -> None:
    zero = _epoch_batches(0, [0, 1])
    two = _epoch_batches(2, [0, 1])  # persistent workers across the two epochs
    for e in (0, 1):
        assert len(zero[e]) == len(two[e]) == 6
        for bz, bt in zip(zero[e], two[e]):
            assert torch.equal(bz["data_idx"][0], bt["data_idx"][0])
            assert torch.equal(bz["data"][0], bt["data"][0])
    assert not torch.equal(zero[0][0]["data_idx"][0], zero[1][0]["data_idx"][0])


# ----------------------------------------------------------------------------- collators


def _fake_sample(idx: int, views: int, label: Optional[int] = None) -> Dict[str, Any]:
    return {
        "data": [torch.full((3, 4, 4), float(10 * idx + v)) for v in range(views)],
        "label": [idx if label is None else label] * views,
        "data_valid": [1] * views,
        "data_idx": [idx] * views,
    }


def test_default_collate_shapes() -> None:
    batch = default_collate([_fake_sample(i, 1) for i in range(5)])
    assert len(batch["data"]) == 1 and batch["data"][0].shape == (5, 3, 4, 4)
    assert batch["label"][0].dtype == torch.int64 and batch["label"][0].tolist() == [0, 1, 2, 3, 4]
    assert batch["data_idx"][0].tolist() == [0, 1, 2, 3, 4] and batch["data_valid"][0].tolist() == [1] * 5
    two = COLLATORS.get("default")([_fake_sample(i, 2) for i in range(3)])
    assert len(two["data"]) == 2 and two["data"][1][2, 0, 0, 0].item() == 21.0
    with pytest.raises(UserError, match="ToTensor"):
        default_collate([{"data": [Image.new("RGB", (2, 2))], "label": [0], "data_valid": [1], "data_idx": [0]}])


def test_simclr_collator_order() -> None:
    n = 3
    batch = simclr_collator([_fake_sample(i, 2) for i in range(n)])
    assert len(batch["data"]) == 1 and batch["data"][0].shape == (2 * n, 3, 4, 4)
    firsts = batch["data"][0][:, 0, 0, 0].tolist()
    assert firsts == [0.0, 10.0, 20.0, 1.0, 11.0, 21.0]  # all view 0, then all view 1
    assert batch["label"][0].tolist() == [0, 1, 2, 0, 1, 2]
    assert batch["data_idx"][0].tolist() == [0, 1, 2, 0, 1, 2]
    with pytest.raises(UserError, match="at least 2 views"):
        simclr_collator([_fake_sample(0, 1)])
    with pytest.raises(UserError, match="COLLATE_FUNCTION_PARAMS"):
        build_collator("simclr_collator", {"bogus": 1}, "TRAIN")


# ----------------------------------------------------------------------------- sampler


def test_sampler_order_is_function_of_seed_and_epoch() -> None:
    def order(seed: int, epoch: int) -> List[int]:
        s = StatefulDistributedSampler(50, seed=seed)
        s.set_epoch(epoch)
        items = list(s)
        assert all(e == epoch for e, _ in items)
        return [i for _, i in items]

    assert order(0, 0) == order(0, 0)
    assert sorted(order(0, 0)) == list(range(50))
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    ref = torch.utils.data.DistributedSampler(range(50), num_replicas=1, rank=0, shuffle=True, seed=3)
    ref.set_epoch(2)
    assert order(3, 2) == list(ref)
    s = StatefulDistributedSampler(10, shuffle=False)
    assert [i for _, i in s] == list(range(10))


@pytest.mark.parametrize("n,drop_last", [(20, False), (21, False), (21, True)])
def test_sampler_shares_disjoint_and_covering(n: int, drop_last: bool) -> None:
    shares = []
    for rank in range(2):
        s = StatefulDistributedSampler(n, num_replicas=2, rank=rank, seed=1, drop_last=drop_last)
        s.set_epoch(3)
        shares.append([i for _, i in s])
        assert len(s) == len(shares[-1])
    assert len(shares[0]) == len(shares[1])
    union = set(shares[0]) | set(shares[1])
    if n % 2 == 0:
        assert set(shares[0]).isdisjoint(shares[1]) and union == set(range(n))
    elif drop_last:
        assert set(shares[0]).isdisjoint(shares[1]) and len(union) == n - 1
    else:  # padded by repeating one index
        assert union == set(range(n)) and len(shares[0]) + len(shares[1]) == n + 1


class CountingDataset(torch.utils.data.Dataset):
    """Records which (epoch, idx) keys were loaded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: List[Any] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: Any) -> Dict[str, Any]:
        self.calls.append(key)
        _, idx = key
        return {"data": [torch.tensor([float(idx)])], "label": [idx], "data_valid": [1], "data_idx": [idx]}


def test_set_start_iter_skips_batches_without_loading_them() -> None:
    ds = CountingDataset(30)
    cfg = make_cfg(BATCHSIZE_PER_REPLICA=4)
    loader = build_dataloader(ds, cfg, "TRAIN", rank=0, world_size=1, device="cpu")
    set_loader_position(loader, 2, 0)
    full = [b["data_idx"][0].tolist() for b in loader]
    ds.calls.clear()
    set_loader_position(loader, 2, 3)
    assert len(loader.sampler) == 30 - 12 and len(loader) == len(full) - 3
    rest = [b["data_idx"][0].tolist() for b in loader]
    assert rest == full[3:]
    assert len(ds.calls) == 30 - 12 and all(e == 2 for e, _ in ds.calls)
    assert get_loader_state(loader) == {"epoch": 2, "start_iter": 3, "seed": 0}
    other = StatefulDistributedSampler(30, batch_size=4)
    other.load_state_dict(loader.sampler.state_dict())
    assert list(other) == list(loader.sampler)
    loader.sampler.set_epoch(3)
    assert loader.sampler.start_iter == 0


# ----------------------------------------------------------------------------- loader


def test_dataloader_shapes_and_test_split_unshuffled() -> None:
    cfg = make_cfg("TEST", DATA_LIMIT=10, BATCHSIZE_PER_REPLICA=4, TRANSFORMS=[{"name": "ToTensor"}])
    loader = build_dataloader(build_dataset(cfg, "TEST"), cfg, "TEST", rank=0, world_size=1, device="cpu")
    batches = list(loader)
    assert [b["data"][0].shape[0] for b in batches] == [4, 4, 2]
    assert torch.cat([b["data_idx"][0] for b in batches]).tolist() == list(range(10))
    assert loader.pin_memory is False


def test_drop_last_with_too_small_dataset_is_a_user_error() -> None:
    cfg = make_cfg(DATA_LIMIT=10, BATCHSIZE_PER_REPLICA=4, DROP_LAST=True)
    ds = build_dataset(cfg, "TRAIN")
    with pytest.raises(UserError, match=r"BATCHSIZE_PER_REPLICA=4.*10 samples|10 samples.*BATCHSIZE_PER_REPLICA=4"):
        build_dataloader(ds, cfg, "TRAIN", rank=0, world_size=3, device="cpu")
    loader = build_dataloader(ds, cfg, "TRAIN", rank=0, world_size=2, device="cpu")
    assert len(loader) == 1


# ----------------------------------------------------------------------------- corrupt images


def _corrupt_tree(tmp_path: Any) -> str:
    root = str(tmp_path / "imgs")
    write_image_tree(root, {"a": 3, "b": 2})
    with open(os.path.join(root, "a", "img1.png"), "wb") as f:
        f.write(b"this is not a png")
    return root


def test_corrupt_image_skip_replaces_and_counts(tmp_path: Any, caplog: Any) -> None:
    root = _corrupt_tree(tmp_path)
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[root], LABEL_SOURCES=["disk_folder"],
                   DATA_LIMIT=-1, TRANSFORMS=[{"name": "ToTensor"}])
    ds = build_dataset(cfg, "TRAIN")
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.dataset"):
        s = ds[1]
    assert ds.num_skipped == 1
    assert "img1.png" in caplog.text
    nxt = ds[2]
    assert torch.equal(s["data"][0], nxt["data"][0])  # replaced by the next valid index
    assert s["data_idx"] == [1] and s["data_valid"] == [-1] and nxt["data_valid"] == [1]
    ds[1]
    assert ds.num_skipped == 2


def test_corrupt_image_error_mode_names_the_file(tmp_path: Any) -> None:
    root = _corrupt_tree(tmp_path)
    cfg = make_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[root], LABEL_SOURCES=[],
                   DATA_LIMIT=-1, ON_CORRUPT_IMAGE="error", TRANSFORMS=[{"name": "ToTensor"}])
    ds = build_dataset(cfg, "TRAIN")
    ds[0]
    with pytest.raises(UserError, match=r"img1\.png.*ON_CORRUPT_IMAGE"):
        ds[1]


def test_batch_reads_match_sample_reads() -> None:
    """__getitems__ looks labels up once per batch; the samples must be those of __getitem__,
    with a DATA_LIMIT subset, padded keys and transforms that draw randomness."""
    from ssl_engine.data.sampler import PaddedIndex

    ds = build_dataset(make_cfg(DATA_LIMIT=40, SYNTHETIC_NUM_CLASSES=7,
                                TRANSFORMS=[{"name": "RandomHorizontalFlip"}, {"name": "ToTensor"}]), "TRAIN")
    keys = [(2, 5), (2, 39), PaddedIndex(2, 0), (2, 17), (3, 5)]
    batch = ds.__getitems__(keys)
    single = [ds[k] for k in keys]
    for b, s in zip(batch, single):
        assert b["label"] == s["label"] and b["data_valid"] == s["data_valid"] and b["data_idx"] == s["data_idx"]
        assert tensors_equal(b["data"], s["data"])
    assert [b["label"][0] for b in batch] == [int(ds.get_labels()[k[1]]) for k in keys]
    assert batch[2]["data_valid"] == [0]
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__([(0, 1), (0, 40)])


# ----------------------------------------------------------------------------- whole-batch reads


class TensorSource:
    """Samples already tensors in memory; ``get_batch`` only when ``batched``."""

    def __init__(self, n: int, dim: int = 6, seed: int = 0, bad: Optional[int] = None) -> None:
        self.x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
        self.bad = bad

    def __len__(self) -> int:
        return len(self.x)

    def get(self, idx: int) -> torch.Tensor:
        if idx == self.bad:
            from ssl_engine.data.sources import UnreadableImageError

            raise UnreadableImageError(f"sample{idx}.npy", "unreadable on purpose")
        return self.x[idx]


class BatchedTensorSource(TensorSource):
    def get_batch(self, indices: np.ndarray) -> torch.Tensor:
        if self.bad is not None and self.bad in indices:
            self.get(self.bad)
        return self.x[torch.from_numpy(indices)]


def _both_paths(ds: SSLDataset, keys: List[Any]) -> tuple:
    ds.collated_reads = False
    per_sample = default_collate(ds.__getitems__(keys))
    ds.collated_reads = True
    return per_sample, default_collate(ds.__getitems__(keys))


def _assert_same_batch(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert len(a[key]) == len(b[key]), key
        for x, y in zip(a[key], b[key]):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), key


@pytest.mark.parametrize("label_type", ["standard", "sample_index", "zero"])
@pytest.mark.parametrize("subset", [None, np.arange(1, 50, 3)])
@pytest.mark.parametrize("num_sources", [1, 2])
def test_whole_batch_reads_equal_the_per_sample_batches(label_type: str, subset: Any, num_sources: int) -> None:
    from ssl_engine.data.sampler import PaddedIndex

    sources = [BatchedTensorSource(50, seed=s) for s in range(num_sources)]
    labels = [np.arange(50, dtype=np.int32) % 7] if label_type == "standard" else []
    ds = SSLDataset(sources, label_arrays=labels, label_type=label_type, subset=subset)
    keys = [(0, 3), (0, 15), (1, 0), PaddedIndex(1, 3), PaddedIndex(1, 15)]
    per_sample, whole = _both_paths(ds, keys)
    _assert_same_batch(per_sample, whole)
    assert whole["data_valid"][0].tolist() == [1, 1, 1, 0, 0]
    assert isinstance(ds.__getitems__(keys), dict)  # one read, no sample dicts


def test_whole_batch_reads_only_where_nothing_runs_per_sample(tmp_path: Any) -> None:
    cfg = make_cfg(BATCHSIZE_PER_REPLICA=4)
    batched = SSLDataset([BatchedTensorSource(12)], label_arrays=[np.arange(12) % 3])
    loader = build_dataloader(batched, cfg, "TRAIN", rank=0, world_size=1, device="cpu")
    assert batched.collated_reads
    plain = SSLDataset([TensorSource(12)], label_arrays=[np.arange(12) % 3])
    build_dataloader(plain, cfg, "TRAIN", rank=0, world_size=1, device="cpu")
    assert not plain.collated_reads and not plain.reads_batches()  # no get_batch
    with_transforms = SSLDataset([BatchedTensorSource(12)], transforms=SSLTransformsWrapper([{"name": "ImgReplicatePil", "num_times": 2}]))
    assert not with_transforms.reads_batches()
    float_labels = SSLDataset([BatchedTensorSource(12)], label_arrays=[np.linspace(0, 1, 12)])
    assert not float_labels.reads_batches()
    other = SSLDataset([BatchedTensorSource(12)], label_arrays=[np.arange(12) % 3])
    build_dataloader(other, make_cfg(BATCHSIZE_PER_REPLICA=4, COLLATE_FUNCTION="simclr_collator"), "TRAIN",
                     rank=0, world_size=1, device="cpu")
    assert not other.collated_reads  # another collator gets the sample dicts it expects
    # the loader's batches are the per-sample ones, epoch after epoch
    for epoch in (0, 1):
        set_loader_position(loader, epoch)
        batched.collated_reads = True
        whole = list(loader)
        batched.collated_reads = False
        for a, b in zip(list(loader), whole):
            _assert_same_batch(a, b)


def test_an_unreadable_sample_in_a_whole_batch_read_is_replaced_as_in_a_sample_read(caplog: Any) -> None:
    ds = SSLDataset([BatchedTensorSource(10, bad=4)], label_arrays=[np.arange(10)])
    ds.collated_reads = True
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.dataset"):
        batch = default_collate(ds.__getitems__([(0, 3), (0, 4), (0, 5)]))
    assert "sample4.npy" in caplog.text and ds.num_skipped == 1
    assert batch["data_valid"][0].tolist() == [1, -1, 1] and batch["label"][0].tolist() == [3, 5, 5]
    assert torch.equal(batch["data"][0][1], ds.sources[0].x[5])
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__([(0, 1), (0, 10)])


class _StuckAfterFirst(torch.utils.data.Dataset):
    """Sample 0 at once; any other sample never comes (a hung read)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i > 0:
            import time

            time.sleep(3600)
        return torch.zeros(1)


def test_stop_workers_ends_even_a_stuck_worker_that_ignores_sigterm() -> None:
    """Loader workers ignore SIGTERM (a preemption signal to the whole job must not kill them),
    so torch's own fallback cannot end a stuck one; stop_workers must, or the run's process
    would wait for it at exit."""
    import functools
    import multiprocessing as mp

    from ssl_engine.data.loader import stop_workers, worker_init_fn

    loader = torch.utils.data.DataLoader(_StuckAfterFirst(), batch_size=1, num_workers=1,
                                         worker_init_fn=functools.partial(worker_init_fn, main_pid=os.getpid()),
                                         multiprocessing_context=mp.get_context("fork"))
    it = iter(loader)
    assert next(it).shape == (1, 1)
    workers = list(it._workers)
    stop_workers(it)
    assert workers and not any(w.is_alive() for w in workers)


def test_test_class_folders_are_numbered_as_the_training_folders(tmp_path, caplog):
    """disk_folder numbers each folder's sorted classes on its own: a TEST folder without the
    training's class 'b' would call 'c' label 1, which the model learned as 'b'. TEST classes are
    numbered as TRAIN's instead; a TEST class that TRAIN lacks is one error naming both folders."""
    from ssl_engine.config import compose
    from ssl_engine.data import build_dataset

    def folder(name, classes):
        for c in classes:
            (tmp_path / name / c).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / name / c / f"{i}.png")
        return tmp_path / name

    train, test, other = folder("tr", "abc"), folder("te", "ac"), folder("te2", "ad")

    def cfg(test_folder):
        return compose(["config=quick/supervised_digits", "config.TEST_MODEL=true",
                        *[f"config.DATA.{s}.{k}" for s, p in (("TRAIN", train), ("TEST", test_folder)) for k in (
                            "DATA_SOURCES=[disk_folder]", "LABEL_SOURCES=[disk_folder]", f"DATA_PATHS=[{p}]")]],
                       warn_unused=False)

    with caplog.at_level(logging.INFO):
        labels = build_dataset(cfg(test), "TEST").get_labels(0)
    assert list(labels) == [0, 0, 2, 2]
    assert "numbered as the 3 of config.DATA.TRAIN.DATA_PATHS[0]" in caplog.text and "no test images of: b" in caplog.text
    assert list(build_dataset(cfg(train), "TEST").get_labels(0)) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(UserError, match=r"class folder\(s\) 'd' of .*te2' are not classes of config.DATA.TRAIN.DATA_PATHS\[0\]"):
        build_dataset(cfg(other), "TEST")
    # an extraction writes each folder's own numbering (retrieval sets have disjoint classes), as VISSL
    extraction = compose(["config=quick/supervised_digits", "engine_name=extract_features",
                          *[f"config.DATA.{s}.{k}" for s, p in (("TRAIN", train), ("TEST", other)) for k in (
                              "DATA_SOURCES=[disk_folder]", "LABEL_SOURCES=[disk_folder]", f"DATA_PATHS=[{p}]")]],
                         warn_unused=False)
    assert list(build_dataset(extraction, "TEST").get_labels(0)) == [0, 0, 1, 1]


def test_a_transform_given_a_parameter_it_lacks_lists_the_ones_it_takes() -> None:
    with pytest.raises(UserError) as e:
        build_transform({"name": "ImgPilGaussianBlur", "kernel": 23}, "config.DATA.TRAIN.TRANSFORMS[3]")
    assert str(e.value) == (
        "config.DATA.TRAIN.TRANSFORMS[3]: bad parameters for transform 'ImgPilGaussianBlur' {'kernel': 23}: "
        "ImgPilGaussianBlur.__init__() got an unexpected keyword argument 'kernel'; it accepts: p, radius_min, "
        "radius_max")


def test_more_loader_workers_than_cpus_is_one_note_instead_of_torchs_warning_per_iterator() -> None:
    """torch warns on every new iterator of every rank when a rank's workers outnumber its CPUs
    (8 lines for 2 ranks and 2 phases); the tool hides that warning and says it once before launch."""
    import warnings

    from ssl_engine.cli import quiet_dependency_warnings
    from ssl_engine.data.loader import worker_count_note

    note = worker_count_note(5, ranks_here=2, cpus=2)
    assert note == ("config.DATA.NUM_DATALOADER_WORKERS=5 loader workers per rank (2 ranks here: 10 workers) on 2 "
                    "CPUs: they may slow each other down; about 1 per rank fits this machine, unless loading mostly "
                    "waits on a disk or network")
    assert worker_count_note(2, ranks_here=2, cpus=2) is None
    saved = os.environ.get("PYTHONWARNINGS")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_dependency_warnings()
        warnings.warn("This DataLoader will create 5 worker processes in total. Our suggested max number of "
                      "worker in current system is 2", UserWarning)
        warnings.warn("an unrelated warning", UserWarning)
    if saved is None:
        os.environ.pop("PYTHONWARNINGS", None)
    else:
        os.environ["PYTHONWARNINGS"] = saved
    assert [str(w.message) for w in seen] == ["an unrelated warning"]


def test_a_hidden_class_folder_stays_a_class_with_a_warning_naming_it(tmp_path, caplog):
    # ImageFolder (and so VISSL) makes .ipynb_checkpoints a class; dropping it would renumber the
    # classes against VISSL's checkpoints, so it stays, and the shift it causes is logged
    from ssl_engine.data.sources import scan_image_folder

    for cls in ("a", "b", ".ipynb_checkpoints"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / cls / "0.png")
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.sources"):
        _, labels, classes = scan_image_folder(str(tmp_path))
    assert classes == [".ipynb_checkpoints", "a", "b"] and labels.tolist() == [0, 1, 2]
    warned = [r.getMessage() for r in caplog.records if "hidden folder" in r.getMessage()]
    assert len(warned) == 1
    assert "'.ipynb_checkpoints'" in warned[0] and "(label 0)" in warned[0]
    assert "class 'a' is 1, 0 without them" in warned[0]


def test_vissls_randaugment_is_not_taken_for_torchvisions(caplog) -> None:
    """VISSL registers its own RandAugment (timm's ops, magnitude on a 0-10 scale) under
    torchvision's name. Its keys are an error naming VISSL's transform (was: only torchvision's
    parameters listed, as if the config had a typo); an entry of magnitude alone, valid for both,
    runs torchvision's with a warning that 9 means another strength than in VISSL (was: silent,
    a third of VISSL's augmentation strength). torchvision's own keys silence the warning."""
    where = "config.DATA.TRAIN.TRANSFORMS[2]"
    with pytest.raises(UserError, match=r"TRANSFORMS\[2\]: RandAugment here is torchvision's \(num_ops, magnitude, "
                                        r"num_magnitude_bins, interpolation, fill\), which does not take magnitude_std, "
                                        r"increasing_severity; a VISSL config's RandAugment is VISSL's RandAugment "
                                        r"\(timm's ops, magnitude on a 0-10 scale"):
        build_transform({"name": "RandAugment", "magnitude": 9, "magnitude_std": 0.5, "increasing_severity": True}, where)
    with pytest.raises(UserError, match=r"does not take n, m, probabilistic; a VISSL config's RandAugment"):
        build_transform({"name": "RandAugment", "n": 5, "m": 15, "probabilistic": True}, where)
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.transforms"):
        name, t, _ = build_transform({"name": "RandAugment", "magnitude": 9}, where)
    assert type(t).__name__ == "RandAugment" and t.magnitude == 9 and t.num_magnitude_bins == 31
    assert ("config.DATA.TRAIN.TRANSFORMS[2]: RandAugment runs torchvision's: num_ops=2, magnitude 9 of "
            "num_magnitude_bins=31 (0-30); a VISSL config's RandAugment is VISSL's") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ssl_engine.data.transforms"):
        build_transform({"name": "RandAugment", "num_ops": 2, "magnitude": 9}, where)
        build_transform({"name": "RandAugment", "magnitude": 9, "num_magnitude_bins": 31}, where)
    assert "RandAugment" not in caplog.text


def test_a_transform_that_fails_on_one_image_names_that_image_through_the_tool(tmp_path: Any) -> None:
    """A RandomCrop that fits every image but one (1x1) in a file list: the line names the sample,
    its file and its size. Was "... (RandomCrop with size=32) failed on data entry 0 (Image): ...;
    check its settings", blaming settings that fit the other images, with nothing to find the one
    image by (in loader workers too)."""
    from conftest import run_tool

    paths = []
    for i in range(8):
        side = 1 if i == 5 else 40
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(np.full((side, side, 3), 7 * i, dtype=np.uint8)).save(paths[-1])
    np.save(tmp_path / "images.npy", np.array(paths))
    np.save(tmp_path / "labels.npy", np.arange(8) % 2)
    proc = run_tool(["config=quick/supervised_digits", "config.OPTIMIZER.num_epochs=1", "config.TEST_MODEL=false",
                     "config.MODEL.TRUNK.NAME=mlp", "config.MODEL.TRUNK.MLP.DIMS=[3072,8]",
                     "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[8,10]}]]", "config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                     "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]", f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'images.npy'}]",
                     f"config.DATA.TRAIN.LABEL_PATHS=[{tmp_path / 'labels.npy'}]", "config.DATA.TRAIN.DATA_LIMIT=-1",
                     "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=1",
                     "config.DATA.TRAIN.TRANSFORMS=[{name:RandomCrop,size:32},{name:ToTensor}]",
                     f"config.CHECKPOINT.DIR={tmp_path / 'run'}"], timeout=180)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    last = err.splitlines()[-1]
    assert "Traceback" not in err, err[-3000:]
    assert last.startswith("error: config.DATA.TRAIN.TRANSFORMS[0] (RandomCrop with size=32) failed on data entry 0 "
                           f"(Image 1x1 RGB) of TRAIN sample 5 ({paths[5]!r}): Required crop size (32, 32) is larger "
                           "than input image size (1, 1)"), last
