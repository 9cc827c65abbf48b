"""Feature extraction: shard writing and loading, the extract_features engine on 1 and 2 ranks,
weights from a checkpoint folder or MODEL.WEIGHTS_INIT, the kNN test, and linear evaluation."""

import importlib.util
import json
import logging
import re
import subprocess
import threading
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from conftest import REPO, run_tool
from ssl_engine.checkpoint import atomic_write, load_checkpoint
from ssl_engine.data import StatefulDistributedSampler
from ssl_engine.errors import CheckpointError, UserError
from ssl_engine.features import (
    FeatureShardError,
    ShardWriter,
    available,
    iter_shards,
    load_features,
    remove_shards,
    extraction_status,
    npy_header,
    shard_path,
    status_path,
    write_extraction_status,
)
from ssl_engine.knn import knn_accuracy

NN_TOOL = str(REPO / "tools" / "nearest_neighbor_test.py")
SHARD_RE = re.compile(r"^rank(\d+)_chunk(\d+)_(train|test)_(\w+)_(features|targets|inds)\.npy$")


def temp_files(folder: Path) -> List[str]:
    return [p.name for p in Path(folder).iterdir() if ".tmp." in p.name]


def write_split(folder: Path, split: str, inds: np.ndarray, rank: int = 0, threshold: int = 0, batch: int = 7,
                layers: Dict[str, tuple] = None) -> Dict[str, np.ndarray]:
    """Write features = f(index) for ``inds`` through a ShardWriter, in batches of ``batch``."""
    layers = layers or {"res5avg": (4,)}
    writer = ShardWriter(folder, rank, split, threshold)
    for s in range(0, len(inds), batch):
        idx = np.asarray(inds[s:s + batch], dtype=np.int64)
        feats = {name: (idx[:, None] * 10.0 + np.arange(int(np.prod(shape)))).reshape((len(idx),) + shape)
                 .astype(np.float32) for name, shape in layers.items()}
        writer.add(feats, idx % 3, idx)
    writer.close()
    return {"chunks": writer.chunk, "samples": writer.num_samples}


# ------------------------------------------------------------------------------- shards


def test_shards_are_chunked_named_and_written_atomically(tmp_path: Path) -> None:
    out = write_split(tmp_path, "TRAIN", np.arange(100), threshold=32, layers={"res5avg": (4,), "res4": (2, 2, 2)})
    assert out == {"chunks": 4, "samples": 100}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert all(SHARD_RE.match(n) for n in names), names
    assert len(names) == 4 * 2 * 3  # chunks x layers x (features, targets, inds)
    sizes = [len(np.load(shard_path(tmp_path, 0, c, "train", "res4", "inds"))) for c in range(4)]
    assert sizes == [32, 32, 32, 4]
    assert temp_files(tmp_path) == []
    assert available(tmp_path) == [("train", "res4"), ("train", "res5avg")]
    res4 = load_features(tmp_path, "train", "res4", flatten=False)
    assert res4["features"].shape == (100, 2, 2, 2)
    assert load_features(tmp_path, "train", "res4")["features"].shape == (100, 8)


def test_load_merges_ranks_and_chunks_sorted_by_index(tmp_path: Path) -> None:
    n = 53  # uneven shares, as the extraction's non-padding sampler gives
    for rank in range(2):
        write_split(tmp_path, "test", np.arange(rank, n, 2), rank=rank, threshold=5, batch=3)
    got = load_features(tmp_path, "test", "res5avg")
    np.testing.assert_array_equal(got["inds"], np.arange(n))
    np.testing.assert_array_equal(got["targets"], np.arange(n) % 3)
    np.testing.assert_array_equal(got["features"][:, 0], np.arange(n) * 10.0)
    shards = list(iter_shards(tmp_path, "test", "res5avg"))
    assert [(s.rank, s.chunk) for s in shards] == [(0, c) for c in range(6)] + [(1, c) for c in range(6)]
    assert sum(len(s.inds) for s in shards) == n


def test_failed_write_leaves_no_temp_file_and_keeps_the_old_shard(tmp_path: Path) -> None:
    path = shard_path(tmp_path, 0, 0, "train", "res5avg", "features")
    np.save(path, np.ones((2, 3), dtype=np.float32))

    def half_then_fail(f) -> None:
        f.write(b"\x93NUMPY partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="disk is full"):
        atomic_write(path, half_then_fail)
    assert temp_files(tmp_path) == []
    np.testing.assert_array_equal(np.load(path), np.ones((2, 3)))


def shard_writer_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shard-writer")]


def test_shards_written_in_the_background_equal_what_was_added(tmp_path: Path) -> None:
    # Many chunks, each written while the next is filled: every file complete, no thread left.
    rng = np.random.default_rng(0)
    inds = rng.permutation(1000)
    out = write_split(tmp_path, "train", inds, threshold=64, batch=10, layers={"res5avg": (6,), "res4": (2, 3)})
    assert out == {"chunks": 16, "samples": 1000}
    assert temp_files(tmp_path) == [] and shard_writer_threads() == []
    got = load_features(tmp_path, "train", "res4", flatten=False)
    np.testing.assert_array_equal(got["inds"], np.arange(1000))
    expected = (np.arange(1000)[:, None] * 10.0 + np.arange(6)).reshape(1000, 2, 3).astype(np.float32)
    np.testing.assert_array_equal(got["features"], expected)
    np.testing.assert_array_equal(got["targets"], np.arange(1000) % 3)


def test_a_split_whose_extraction_did_not_finish_is_refused(tmp_path: Path) -> None:
    # shards of a killed extraction: the status file still says running
    write_extraction_status(tmp_path, "train", "running")
    write_split(tmp_path, "train", np.arange(30), threshold=8, batch=5)
    with pytest.raises(FeatureShardError, match="the train extraction in .* did not finish"):
        load_features(tmp_path, "train", "res5avg")
    with pytest.raises(FeatureShardError, match="did not finish"):
        list(iter_shards(tmp_path, "train", "res5avg"))
    # complete, but a shard went missing since
    write_extraction_status(tmp_path, "train", "complete", samples=30)
    assert len(load_features(tmp_path, "train", "res5avg")["inds"]) == 30
    write_extraction_status(tmp_path, "train", "complete", samples=40)
    with pytest.raises(FeatureShardError, match="30 samples, but the extraction wrote 40"):
        load_features(tmp_path, "train", "res5avg")
    # the streaming reader too, before it gives the first shard (was: part of the split, no error)
    with pytest.raises(FeatureShardError, match="30 samples, but the extraction wrote 40"):
        next(iter_shards(tmp_path, "train", "res5avg"))
    # shards without a status file (written by VISSL) are read as they are
    status_path(tmp_path, "train").unlink()
    assert len(load_features(tmp_path, "train", "res5avg")["inds"]) == 30
    assert sum(len(sh.inds) for sh in iter_shards(tmp_path, "train", "res5avg")) == 30


def test_shards_must_have_the_shape_and_dtype_the_extraction_wrote(tmp_path: Path) -> None:
    """extraction_<split>.json records each layer's per-sample shape and dtype; a shard rewritten
    since (cut to fewer columns, saved as float64) is refused by both readers (was: read as it was,
    and a kNN ran on it)."""
    write_split(tmp_path, "train", np.arange(30), threshold=8, batch=5)
    good = {"res5avg": {"shape": [4], "dtype": "float32"}}
    write_extraction_status(tmp_path, "train", "complete", samples=30, layers=good)
    assert load_features(tmp_path, "train", "res5avg")["features"].shape == (30, 4)
    assert sum(len(sh.inds) for sh in iter_shards(tmp_path, "train", "res5avg")) == 30
    for layers, says in (({"res5avg": {"shape": [5], "dtype": "float32"}}, "float32 features of shape \\[4\\] per "
                          "sample, but the extraction wrote float32 of shape \\[5\\]"),
                         ({"res5avg": {"shape": [4], "dtype": "float64"}}, "wrote float64 of shape \\[4\\]")):
        write_extraction_status(tmp_path, "train", "complete", samples=30, layers=layers)
        with pytest.raises(FeatureShardError, match=says):
            load_features(tmp_path, "train", "res5avg")
        with pytest.raises(FeatureShardError, match=says):
            next(iter_shards(tmp_path, "train", "res5avg"))


def test_targets_of_another_dtype_than_the_extraction_wrote_are_refused(tmp_path: Path) -> None:
    """A targets shard rewritten as float32 (a label 2.5) was read into the first shard's int64 as
    2, without a word: refused against the status file's targets_dtype, and without a status file
    (VISSL's shards) because the split's shards disagree. A shard of no rows has nothing to cast."""
    write_split(tmp_path, "train", np.arange(30), threshold=8, batch=5)
    good = {"res5avg": {"shape": [4], "dtype": "float32", "targets_dtype": "int64"}}
    write_extraction_status(tmp_path, "train", "complete", samples=30, layers=good)
    assert load_features(tmp_path, "train", "res5avg")["targets"].dtype == np.int64
    # every targets shard rewritten: the shards agree, the status file does not
    shards = sorted(tmp_path.glob("rank0_chunk*_train_res5avg_targets.npy"))
    for path in shards:
        np.save(path, np.load(path).astype(np.float32) + 0.5)
    says = "rank0_chunk0_train_res5avg holds float32 targets, but the extraction wrote int64"
    with pytest.raises(FeatureShardError, match=says):
        load_features(tmp_path, "train", "res5avg")
    with pytest.raises(FeatureShardError, match=says):
        next(iter_shards(tmp_path, "train", "res5avg"))
    # one rewritten, no status file (VISSL's shards): the split's shards disagree
    status_path(tmp_path, "train").unlink()
    for path in shards[:-1]:
        np.save(path, np.load(path).astype(np.int64))
    last = shards[-1]
    says = ("rank0_chunk3_train_res5avg holds float32 features and float32 targets, rank0_chunk0_train_res5avg "
            "float32 and int64")
    with pytest.raises(FeatureShardError, match=says):
        load_features(tmp_path, "train", "res5avg")
    with pytest.raises(FeatureShardError, match=says):
        next(iter_shards(tmp_path, "train", "res5avg"))
    # a shard of no rows, of another dtype, beside the others: read (nothing in it to cast)
    np.save(last, np.load(last).astype(np.int64))
    for kind, empty in (("features", np.zeros((0, 4), np.float64)), ("targets", np.zeros(0, np.float32)),
                        ("inds", np.zeros(0, np.int64))):
        np.save(tmp_path / f"rank1_chunk0_train_res5avg_{kind}.npy", empty)
    out = load_features(tmp_path, "train", "res5avg")
    assert out["targets"].dtype == np.int64 and out["features"].dtype == np.float32 and len(out["inds"]) == 30


@pytest.mark.parametrize("edit, says", [
    ({"samples": "30"}, "its samples is '30', not a count"),
    ({"samples": None}, "its samples is None, not a count"),
    ({"status": 1}, "its status is 1, not running, complete or failed"),
    ({"classes": ["a", "a"]}, "its classes is ['a', 'a'], not a list of distinct class names"),
    ({"classes": 5}, "its classes is 5"),
    ({"layers": "x"}, "its layers is 'x'"),
    ({"unreadable": ["3"]}, "its unreadable is ['3']"),
    ({"label_type": "bogus"}, "its label_type is 'bogus'"),
])
def test_a_status_file_edited_by_hand_is_refused_naming_the_field(tmp_path: Path, edit, says) -> None:
    """A status file with a field of another type was read as far as it went: samples as a string
    let a removed shard go unnoticed, and a reordered class list renumbered the labels."""
    write_split(tmp_path, "train", np.arange(30), threshold=8, batch=5)
    write_extraction_status(tmp_path, "train", "complete", samples=30, layers={"res5avg": {}}, label_type="standard")
    status = json.loads(status_path(tmp_path, "train").read_text())
    status.update(edit)
    status_path(tmp_path, "train").write_text(json.dumps(status))
    with pytest.raises(FeatureShardError, match=re.escape(f"extraction_train.json is not a status file of this engine "
                                                          f"({says}")):
        load_features(tmp_path, "train", "res5avg")


@pytest.mark.parametrize("step", ["append", "finish"])
def test_a_failed_background_write_raises_and_leaves_no_temp_file_or_thread(tmp_path: Path, monkeypatch,
                                                                            step: str) -> None:
    """The disk fills up while a features file is written (a block appended, or its closing
    fsync): the error says so, and no temporary file, shard or writer thread is left."""
    import ssl_engine.features as features

    real = getattr(features._ShardFile, step)

    def disk_full_on_features(self, *args) -> None:
        if "features" in self.path.name and (step == "finish" or self.rows):  # its second block
            self._file.write(b"partial")
            raise OSError(28, "No space left on device")
        real(self, *args)

    monkeypatch.setattr(features._ShardFile, step, disk_full_on_features)
    with pytest.raises(CheckpointError, match="disk is full"):
        write_split(tmp_path, "train", np.arange(20), threshold=8, batch=4)
    assert temp_files(tmp_path) == [] and shard_writer_threads() == []
    assert not list(tmp_path.glob("*_features.npy"))


def test_a_full_disk_with_rows_left_in_the_file_buffer_is_still_one_error(tmp_path: Path, monkeypatch) -> None:
    """A small block stays in the file's buffer when the disk is full; closing the file to remove
    it tries that flush again. The write still ends in the disk-full error, with no temporary file."""
    import ssl_engine.features as features

    real = features._ShardFile.append

    class FullDisk:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, data) -> int:
            return len(data)  # buffered

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            self.f.close()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fill_up(self, block) -> None:
        if "features" in self.path.name and self.rows:
            self._file = FullDisk(self._file)
        real(self, block)

    monkeypatch.setattr(features._ShardFile, "append", fill_up)
    with pytest.raises(CheckpointError, match="disk is full"):
        write_split(tmp_path, "train", np.arange(20), threshold=8, batch=2)
    assert temp_files(tmp_path) == [] and shard_writer_threads() == []


def test_a_batch_whose_dtype_would_lose_values_is_refused(tmp_path: Path) -> None:
    """A shard takes its first batch's dtype: a later batch is cast only when that loses nothing
    (int8 targets after int8, float16 into a float32 shard), else refused, not silently narrowed."""
    idx = np.arange(4)
    with ShardWriter(tmp_path, 0, "train", 8) as writer:
        writer.add({"res5avg": np.ones((4, 2), np.float32)}, idx.astype(np.int8), idx)
        writer.add({"res5avg": np.ones((4, 2), np.float16)}, idx.astype(np.int8), idx + 4)
    assert np.load(shard_path(tmp_path, 0, 0, "train", "res5avg", "features")).dtype == np.float32
    for features_dtype, targets, message in ((np.float64, idx.astype(np.int8), "layer 'res5avg' is float64"),
                                             (np.float32, idx * 300, "targets is int64")):
        with pytest.raises(ValueError, match=message + r", earlier batches were \w+ \(it would lose values\)"):
            with ShardWriter(tmp_path / "x", 0, "train", 8) as writer:
                writer.add({"res5avg": np.ones((4, 2), np.float32)}, idx.astype(np.int8), idx)
                writer.add({"res5avg": np.full((4, 2), 1e5, features_dtype)}, targets, idx + 4)
        assert temp_files(tmp_path / "x") == []


def test_shard_headers_hold_the_real_row_count_and_keep_the_data_aligned(tmp_path: Path) -> None:
    """Rows are streamed behind a header sized for a full chunk: a short last chunk gets a header
    of the same size with its own count, readable by numpy (also memory-mapped)."""
    write_split(tmp_path, "train", np.arange(13), threshold=10, batch=4, layers={"res4": (2, 3)})
    last = shard_path(tmp_path, 0, 1, "train", "res4", "features")
    mapped = np.load(last, mmap_mode="r")
    assert mapped.shape == (3, 2, 3) and mapped.offset % 64 == 0
    np.testing.assert_array_equal(mapped[:, 0, 0], [100.0, 110.0, 120.0])
    full = shard_path(tmp_path, 0, 0, "train", "res4", "targets")
    np.testing.assert_array_equal(np.load(full), np.arange(10) % 3)
    assert len(npy_header(np.float32, (3, 2, 3), 128)) == 128
    with pytest.raises(ValueError, match="needs"):
        npy_header(np.float32, (10 ** 60, 2), 128)


def test_add_waits_while_more_than_a_chunk_is_not_written(tmp_path: Path, monkeypatch) -> None:
    """A disk slower than the model: ``add`` blocks once the batches not yet written hold more
    than a chunk, so memory stays bounded instead of queueing the whole split."""
    import ssl_engine.features as features

    gate = threading.Event()
    real = features._ShardFile.append

    def slow_append(self, block) -> None:
        gate.wait(10)
        real(self, block)

    monkeypatch.setattr(features._ShardFile, "append", slow_append)
    added: List[int] = []
    writer = ShardWriter(tmp_path, 0, "train", 8)

    def produce() -> None:
        for s in range(0, 24, 4):
            idx = np.arange(s, s + 4)
            writer.add({"res5avg": np.ones((4, 2), np.float32)}, idx % 3, idx)
            added.append(s)

    t = threading.Thread(target=produce)
    t.start()
    t.join(0.5)
    assert added == [0, 4], added  # the third batch would make 12 rows not yet written, over a chunk of 8
    gate.set()
    t.join(10)
    writer.close()
    assert added == [0, 4, 8, 12, 16, 20] and writer.chunk == 3
    assert len(load_features(tmp_path, "train", "res5avg")["inds"]) == 24


def test_an_error_while_extracting_stops_the_writer_threads(tmp_path: Path) -> None:
    idx = np.arange(4)
    with pytest.raises(RuntimeError, match="model failed"):
        with ShardWriter(tmp_path, 0, "train", 4) as writer:
            writer.add({"res5avg": np.ones((4, 2), np.float32)}, idx % 3, idx)  # a full chunk: being written
            raise RuntimeError("model failed")
    assert temp_files(tmp_path) == [] and shard_writer_threads() == []


def test_remove_shards_only_touches_the_split(tmp_path: Path) -> None:
    write_split(tmp_path, "train", np.arange(10))
    write_split(tmp_path, "test", np.arange(4))
    assert remove_shards(tmp_path, "TRAIN") == 3
    assert available(tmp_path) == [("test", "res5avg")]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("empty", "no feature shards for split 'train' and layer 'res5avg'"),
        ("missing_folder", "does not exist"),
        # a shard named where its folder belongs was said not to exist
        # was "10 samples but indices run from -1 to 9; 0 are missing"
        ("negative_index", "rank0_chunk0_train_res5avg holds the sample index -1; a sample index is >= 0"),
        ("file_for_folder", "features folder .*rank0_chunk0_train_res5avg_features.npy is a file, not the folder of shards"),
        ("no_targets", "has no targets file"),
        ("duplicate", "sample index 0 appears more than once \\(10 repeats\\); shards of two extractions are mixed"),
        ("duplicate_in_one_shard", "sample index 0 appears more than once \\(1 repeats\\)"),
        # names the file (was: rank0_chunk0_*, and numpy's "mmap length is greater than file size")
        ("truncated", "cannot read feature shard .*/rank0_chunk0_train_res5avg_features.npy: it is shorter than its "
                      "header says \\(truncated\\)"),
        ("rank_gap", "has shards of ranks \\[1\\]"),
        ("index_gap", "has chunks \\[0, 2\\] of rank 0; chunk 1 is missing"),
        ("index_gap_status", "16 samples but indices run from 0 to 17; 2 are missing"),
        ("shape", "has features \\(5,\\)"),
        ("rows", "rows"),
        # were tracebacks (TypeError / ValueError) deep in load_features
        ("scalar_inds", "its inds file holds a int64 array of shape \\(\\); inds are one integer per sample"),
        ("2d_inds", "its inds file holds a int64 array of shape \\(8, 1\\)"),
        ("str_targets", "its targets file holds a <U1 array of shape \\(8,\\); targets are numbers"),
    ],
)
def test_loader_explains_empty_or_inconsistent_folders(tmp_path: Path, damage: str, message: str) -> None:
    folder = tmp_path / "f"
    folder.mkdir()
    if damage == "missing_folder":
        folder = tmp_path / "nope"
    elif damage == "negative_index":
        write_split(folder, "train", np.arange(10))
        inds = np.load(shard_path(folder, 0, 0, "train", "res5avg", "inds"))
        np.save(shard_path(folder, 0, 0, "train", "res5avg", "inds"), np.where(inds == 0, -1, inds))
    elif damage == "file_for_folder":
        write_split(folder, "train", np.arange(10))
        folder = shard_path(folder, 0, 0, "train", "res5avg", "features")
    elif damage == "no_targets":
        write_split(folder, "train", np.arange(10))
        shard_path(folder, 0, 0, "train", "res5avg", "targets").unlink()
    elif damage == "duplicate":
        write_split(folder, "train", np.arange(10), rank=0)
        write_split(folder, "train", np.arange(10), rank=1)
    elif damage == "duplicate_in_one_shard":
        write_split(folder, "train", np.arange(8))
        np.save(shard_path(folder, 0, 0, "train", "res5avg", "inds"), np.array([0, 0, 2, 3, 4, 5, 6, 7]))
    elif damage == "truncated":
        write_split(folder, "train", np.arange(8))
        path = shard_path(folder, 0, 0, "train", "res5avg", "features")
        path.write_bytes(path.read_bytes()[:-16])
    elif damage == "rank_gap":
        write_split(folder, "train", np.arange(10), rank=1)
    elif damage == "index_gap_status":  # whole chunks, but samples 8 and 9 are in none
        write_split(folder, "train", np.r_[0:8, 10:18], threshold=8, batch=4)
    elif damage == "index_gap":
        write_split(folder, "train", np.arange(20), threshold=8, batch=4)
        for kind in ("features", "targets", "inds"):
            shard_path(folder, 0, 1, "train", "res5avg", kind).unlink()
    elif damage == "shape":
        write_split(folder, "train", np.arange(8), threshold=4, batch=4)
        np.save(shard_path(folder, 0, 1, "train", "res5avg", "features"), np.zeros((4, 5), np.float32))
    elif damage == "rows":
        write_split(folder, "train", np.arange(8))
        np.save(shard_path(folder, 0, 0, "train", "res5avg", "inds"), np.arange(3))
    elif damage == "scalar_inds":
        write_split(folder, "train", np.arange(8))
        np.save(shard_path(folder, 0, 0, "train", "res5avg", "inds"), np.array(5))
    elif damage == "2d_inds":
        write_split(folder, "train", np.arange(8))
        np.save(shard_path(folder, 0, 0, "train", "res5avg", "inds"), np.arange(8).reshape(8, 1))
    elif damage == "str_targets":
        write_split(folder, "train", np.arange(8))
        np.save(shard_path(folder, 0, 0, "train", "res5avg", "targets"), np.array(list("abcdefgh")))
    with pytest.raises(FeatureShardError, match=message) as info:
        load_features(folder, "train", "res5avg")
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)


def test_non_padding_sampler_gives_each_index_once_and_keeps_padding_by_default() -> None:
    n, world = 11, 3
    shares = [list(StatefulDistributedSampler(n, world, r, shuffle=False, pad=False)) for r in range(world)]
    assert [len(s) for s in shares] == [4, 4, 3]
    assert [len(StatefulDistributedSampler(n, world, r, shuffle=False, pad=False)) for r in range(world)] == [4, 4, 3]
    assert sorted(idx for s in shares for _, idx in s) == list(range(n))
    padded = [list(StatefulDistributedSampler(n, world, r, shuffle=False)) for r in range(world)]
    assert [len(s) for s in padded] == [4, 4, 4]


# ------------------------------------------------------------------------------- kNN


def test_knn_weighted_vote_on_a_toy_problem() -> None:
    # One train point of class 0 right next to the query, two of class 1 a bit farther: a sharp
    # vote (small sigma) follows the closest, a flat one (large sigma) the majority.
    angle = lambda a: [np.cos(a), np.sin(a)]  # noqa: E731
    train = np.array([angle(0.05), angle(0.5), angle(0.55), angle(3.0)], dtype=np.float32) * [[1], [3], [2], [5]]
    labels = np.array([0, 1, 1, 2])
    query = np.array([angle(0.0)], dtype=np.float32)
    sharp = knn_accuracy(train, labels, query, np.array([0]), topk=3, sigma=0.01, topk_list=[1, 2])
    flat = knn_accuracy(train, labels, query, np.array([0]), topk=3, sigma=10.0, topk_list=[1, 2])
    assert sharp == {1: 100.0, 2: 100.0}
    assert flat == {1: 0.0, 2: 100.0}
    # k=1 is nearest-neighbour; class 2 is never among the 3 nearest
    assert knn_accuracy(train, labels, query, np.array([2]), topk=3, sigma=0.1, topk_list=[1, 3])[1] == 0.0


def test_knn_without_l2_norm_ranks_by_dot_product_and_never_overflows() -> None:
    """L2_NORM_FEATS false (VISSL's default) compares raw dot products: a long train vector
    wins over a closer short one. Huge products (exp(2600 / 0.01)) still vote in float32."""
    train = np.array([[1.0, 0.0], [3.0, 3.0], [-5.0, 0.0]], dtype=np.float32)  # class 0 is the closest by angle
    labels = np.array([0, 1, 2])
    query = np.array([[1.0, 0.1]], dtype=np.float32)
    cosine = knn_accuracy(train, labels, query, np.array([0]), topk=2, sigma=0.01, topk_list=[1])
    dot = knn_accuracy(train, labels, query, np.array([0]), topk=2, sigma=0.01, topk_list=[1], l2_norm=False)
    assert cosine == {1: 100.0} and dot == {1: 0.0}
    assert knn_accuracy(train, labels, query, np.array([1]), topk=2, sigma=0.01, topk_list=[1], l2_norm=False) == {1: 100.0}
    huge = knn_accuracy(train * 1000, labels, query * 1000, np.array([1]), topk=3, sigma=0.01, topk_list=[1, 2],
                        l2_norm=False)
    assert huge == {1: 100.0, 2: 100.0}


def test_knn_is_independent_of_the_test_chunk_size() -> None:
    rng = np.random.RandomState(0)
    centers = rng.randn(4, 16)
    ytr, yte = rng.randint(0, 4, 300), rng.randint(0, 4, 101)
    xtr = centers[ytr] + 0.8 * rng.randn(300, 16)
    xte = centers[yte] + 0.8 * rng.randn(101, 16)
    results = [knn_accuracy(xtr, ytr, xte, yte, topk=20, sigma=0.1, topk_list=[1, 5], chunk_size=c) for c in (1, 7, 1024)]
    assert results[0] == results[1] == results[2]
    assert results[0][1] > 80.0 and results[0][5] == 100.0  # 4 classes: top-5 is every class
    with pytest.raises(UserError, match="dim"):
        knn_accuracy(xtr, ytr, xte[:, :3], yte)


def test_knn_votes_over_the_train_classes_whatever_their_ids() -> None:
    """Label ids are names, not sizes: ids up to 10**12 vote like 0, 1, 2 (a table as wide as the
    largest id asked for terabytes), a test label no train sample has is never a hit even when
    top-k reaches past the train classes, and fractional targets are refused, not truncated."""
    rng = np.random.RandomState(0)
    centers = rng.randn(3, 8)
    ytr, yte = rng.randint(0, 3, 90), rng.randint(0, 3, 30)
    xtr, xte = centers[ytr] + 0.3 * rng.randn(90, 8), centers[yte] + 0.3 * rng.randn(30, 8)
    small = knn_accuracy(xtr, ytr, xte, yte, topk=10, sigma=0.1, topk_list=[1, 2])
    ids = np.array([7, 10 ** 12, 3 * 10 ** 9])
    assert knn_accuracy(xtr, ids[ytr], xte, ids[yte], topk=10, sigma=0.1, topk_list=[1, 2]) == small
    assert small[1] > 90.0
    unseen = np.full(30, 5)  # in no train sample: the 3 train classes fill top-5, none is a hit
    assert knn_accuracy(xtr, ytr, xte, unseen, topk=10, sigma=0.1, topk_list=[1, 5]) == {1: 0.0, 5: 0.0}
    assert knn_accuracy(xtr, ytr.astype(np.float32), xte, yte.astype(np.float64), topk=10, sigma=0.1,
                        topk_list=[1, 2]) == small
    with pytest.raises(UserError, match=r"the train targets are not class ids \(float64 values such as 0.5\)"):
        knn_accuracy(xtr, ytr + 0.5, xte, yte)


# ------------------------------------------------------------------------------- end to end


def tool(args: List[str], script: str = None, ok: bool = True):
    proc = run_tool(args, script=script) if script else run_tool(args)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


DIGITS_SMALL = ["config.DATA.TRAIN.DATA_LIMIT=101", "config.DATA.TEST.DATA_LIMIT=37"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A (very short) quick/simclr_digits training: two iterations of 32 images."""
    folder = tmp_path_factory.mktemp("simclr")
    tool(["config=quick/simclr_digits", f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=1",
          "config.DATA.TRAIN.DATA_LIMIT=64", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32"])
    assert (folder / "checkpoint.torch").exists()
    return folder


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def one_rank(pretrained: Path, tmp_path_factory) -> Dict[str, object]:
    """1-rank extraction of the trained trunk through the kNN tool (which extracts first)."""
    out = tmp_path_factory.mktemp("one_rank")
    # what a writer killed mid-shard leaves behind (its pid is gone): removed when extraction starts
    dead_pid = _dead_pid()
    (out / f".rank0_chunk0_train_res5avg_features.npy.tmp.{dead_pid}").write_bytes(b"\x93NUMPY half")
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={pretrained}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}", "config.NEAREST_NEIGHBOR.TOPK=5", *DIGITS_SMALL],
                script=NN_TOOL)
    return {"folder": out, "stdout": proc.stdout}


def test_extraction_with_one_and_two_ranks_gives_the_same_features(pretrained: Path, one_rank, tmp_path: Path) -> None:
    two = tmp_path / "two"
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={pretrained}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={two}", "config.EXTRACT_FEATURES.CHUNK_THRESHOLD=16",
                 "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", *DIGITS_SMALL])
    assert "train res5avg: 101 samples, features [101, 512]" in proc.stdout
    assert "test res5avg: 37 samples" in proc.stdout
    names = sorted(p.name for p in two.iterdir())
    assert names[:2] == ["extraction_test.json", "extraction_train.json"]
    assert all(SHARD_RE.match(n) for n in names[2:]), names
    status = extraction_status(two, "TRAIN")
    weights = status.pop("weights")  # the checkpoint the folder's pointer names, with its size and time
    assert weights.startswith(f"{(pretrained / 'checkpoint.torch').resolve()} (") and " bytes, modified " in weights
    # the time is a date a reader can read, to the nanosecond (two saves in one second differ)
    assert re.search(r" bytes, modified 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d\.\d{9} UTC\)$", weights), weights
    assert status == {"status": "complete", "split": "train", "samples": 101,
                      "layers": {"res5avg": {"shape": [512], "dtype": "float32", "targets_dtype": "int64"}},
                      "label_type": "standard"}  # digits: no class folders, no names
    # 101 train samples: rank 0 gets 51 (chunks of 16, 16, 16, 3), rank 1 gets 50 (16, 16, 16, 2)
    for rank, last in ((0, 3), (1, 2)):
        sizes = [len(np.load(shard_path(two, rank, c, "train", "res5avg", "inds"))) for c in range(4)]
        assert sizes == [16, 16, 16, last]
    assert not shard_path(two, 0, 4, "train", "res5avg", "inds").exists()
    for split, n in (("train", 101), ("test", 37)):
        a = load_features(one_rank["folder"], split, "res5avg")
        b = load_features(two, split, "res5avg")
        np.testing.assert_array_equal(b["inds"], np.arange(n))  # each index once
        np.testing.assert_array_equal(a["targets"], b["targets"])
        assert a["features"].shape == (n, 512)
        np.testing.assert_allclose(a["features"], b["features"], rtol=1e-4, atol=1e-5)
    assert temp_files(two) == [] and temp_files(one_rank["folder"]) == []


def test_knn_tool_extracts_first_then_reports_and_reads_a_features_path(pretrained: Path, one_rank, capsys) -> None:
    line = [l for l in one_rank["stdout"].splitlines() if l.startswith("kNN res5avg")]
    assert line and "101 train / 37 test" in line[0], one_rank["stdout"][-2000:]
    top1 = float(re.search(r"top-1 ([\d.]+)%", line[0]).group(1))
    # the same numbers when reading the folder: in-process, no extraction
    spec = importlib.util.spec_from_file_location("nearest_neighbor_test", NN_TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ssl_engine.cli import prepare_config

    cfg = prepare_config(["config=extract/simclr_digits_trunk", "config.NEAREST_NEIGHBOR.TOPK=5",
                          f"config.NEAREST_NEIGHBOR.FEATURES.PATH={one_rank['folder']}"])
    results = mod.evaluate(cfg, Path(cfg.NEAREST_NEIGHBOR.FEATURES.PATH))
    assert results["res5avg"][1] == pytest.approx(top1, abs=0.01)
    assert set(results["res5avg"]) == {1, 5}
    assert "(k=5, sigma=0.1, cosine; " in line[0]  # the digits configs set L2_NORM_FEATS: true
    # L2_NORM_FEATS false (VISSL's default): raw dot products; a TOPK over the train size is capped, and said
    cfg.NEAREST_NEIGHBOR.L2_NORM_FEATS, cfg.NEAREST_NEIGHBOR.TOPK = False, 1000
    dot = mod.evaluate(cfg, Path(cfg.NEAREST_NEIGHBOR.FEATURES.PATH))["res5avg"]
    train, test = (load_features(one_rank["folder"], s, "res5avg") for s in ("train", "test"))
    assert dot == knn_accuracy(train["features"], train["targets"], test["features"], test["targets"], topk=101,
                               sigma=0.1, topk_list=[1, 5], l2_norm=False)
    assert "(k=101 (TOPK=1000 capped at the train size), sigma=0.1, dot product; " in capsys.readouterr().out


def test_knn_warns_when_the_splits_come_from_different_weights(pretrained: Path, one_rank, tmp_path: Path,
                                                               caplog) -> None:
    """Each split's status file records the weights it was extracted with: a split extracted again
    from other weights (here a random init) no longer silently pairs with the other's features."""
    import json
    import logging
    import shutil

    from ssl_engine.knn import load_train_and_test

    folder = tmp_path / "features"
    shutil.copytree(one_rank["folder"], folder)
    recorded = json.loads((folder / "extraction_train.json").read_text())["weights"]
    assert recorded.startswith(str((pretrained / "checkpoint.torch").resolve())) and " bytes, modified " in recorded
    with caplog.at_level(logging.WARNING):
        load_train_and_test(folder, "res5avg")
    assert "different weights" not in caplog.text
    (tmp_path / "untrained").mkdir()
    tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={tmp_path / 'untrained'}",
          f"config.EXTRACT_FEATURES.OUTPUT_DIR={folder}", "config.EXTRACT_FEATURES.SPLITS=[TEST]", *DIGITS_SMALL])
    assert json.loads((folder / "extraction_test.json").read_text())["weights"].startswith("random init (SEED_VALUE=")
    with caplog.at_level(logging.WARNING):
        load_train_and_test(folder, "res5avg")
    assert "the train and test features in" in caplog.text and "come from different weights" in caplog.text


def test_knn_tool_reports_a_bad_features_path_in_one_line(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("nearest_neighbor_test", NN_TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = mod.main(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and str(tmp_path) in err[0]
    # merged or renamed feature files (train_res5avg_features.npy) are named as not read; VISSL's older
    # chunk-less shards (rank0_train_...) are read, and here give the train split only
    for name in ("train_res5avg_features.npy", "rank0_train_res5avg_features.npy"):
        np.save(tmp_path / name, np.zeros((2, 3), dtype=np.float32))
    code = mod.main(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert ("has no layer with both train and test features (train/res5avg); shards are named "
            "rank<R>_chunk<C>_<split>_<layer>_<features|targets|inds>.npy (or VISSL's older rank<R>_<split>_<layer>_...), "
            "and its other .npy files ('train_res5avg_features.npy') are not: merged or renamed files are not read") in err[0], err
    code = mod.main(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path / 'gone'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: config.NEAREST_NEIGHBOR.FEATURES.PATH: {tmp_path / 'gone'} does not exist; name "
                                 f"the folder the extract_features engine wrote (its EXTRACT_FEATURES.OUTPUT_DIR), or "
                                 f"leave it empty to extract first"]


@pytest.mark.parametrize("override, says", [
    ("config.NEAREST_NEIGHBOR.TOPK_LIST=[]", "config.NEAREST_NEIGHBOR.TOPK_LIST=[] is out of range: expected a list of one "
     "or more integers > 0"),
    ("config.NEAREST_NEIGHBOR.TOPK_LIST=[1,-5]", "config.NEAREST_NEIGHBOR.TOPK_LIST=[1, -5] is out of range"),
    ("config.NEAREST_NEIGHBOR.TOPK=0", "config.NEAREST_NEIGHBOR.TOPK=0 is out of range: expected an integer > 0"),
    ("config.NEAREST_NEIGHBOR.TEST_CHUNK_SIZE=0", "config.NEAREST_NEIGHBOR.TEST_CHUNK_SIZE=0 is out of range"),
])
def test_knn_settings_out_of_range_are_one_line_before_any_extraction(tmp_path: Path, capsys, override, says) -> None:
    """An empty or negative TOPK_LIST was a ValueError / RuntimeError traceback out of the vote,
    after the whole extraction had run: each option is checked first, in one line."""
    spec = importlib.util.spec_from_file_location("nearest_neighbor_test", NN_TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "features"
    code = mod.main(["config=extract/simclr_digits_trunk", f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}",
                     f"config.CHECKPOINT.DIR={tmp_path / 'run'}", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert not out.exists() and not (tmp_path / "run").exists()  # refused before anything ran


def test_knn_accuracy_refuses_settings_out_of_range_in_one_line() -> None:
    """The same checks for a caller of the function (an empty top-k list was a ValueError of max())."""
    from ssl_engine.knn import knn_accuracy

    x, y = np.eye(4, dtype=np.float32), np.arange(4)
    for kwargs, says in [({"topk_list": []}, "TOPK_LIST=[] must list"), ({"topk_list": [0]}, "TOPK_LIST=[0] must list"),
                         ({"topk": 0}, "TOPK=0 must be an integer >= 1"), ({"sigma": 0.0}, "SIGMA=0.0 must be a number > 0"),
                         ({"chunk_size": 0}, "TEST_CHUNK_SIZE=0 must be an integer >= 1")]:
        with pytest.raises(UserError, match=re.escape(says)):
            knn_accuracy(x, y, x, y, **kwargs)


def test_weights_init_file_gives_the_checkpoint_folders_features(pretrained: Path, one_rank, tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={fresh}", "config.EXTRACT_FEATURES.SPLITS=[TEST]",
          f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={pretrained / 'checkpoint.torch'}", *DIGITS_SMALL])
    assert available(fresh) == [("test", "res5avg")]
    a = load_features(one_rank["folder"], "test", "res5avg")["features"]
    b = load_features(fresh, "test", "res5avg")["features"]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # no weights at all: the random init, which must differ from the trained trunk
    rand = tmp_path / "rand"
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={rand}", "config.EXTRACT_FEATURES.SPLITS=[TEST]",
                 *DIGITS_SMALL])
    assert "randomly initialised" in proc.stdout + proc.stderr
    c = load_features(rand, "test", "res5avg")["features"]
    assert not np.allclose(a, c, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("collator", ["simclr_collator", "moco_collator"])
def test_extraction_refuses_augmented_multi_view_batches(pretrained: Path, tmp_path: Path, collator: str) -> None:
    """Two augmented views per sample are refused, also where the collator hands the second over
    beside ``data`` (moco_collator's ``data_momentum``: the features of view 0 were written)."""
    proc = tool(["config=quick/simclr_digits", "engine_name=extract_features", f"config.CHECKPOINT.DIR={pretrained}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={tmp_path}", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]",
                 "config.DATA.TRAIN.DATA_LIMIT=8", f"config.DATA.TRAIN.COLLATE_FUNCTION={collator}"], ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("error: ") and "2 inputs per sample" in err[-1] and "ImgReplicatePil" in err[-1]


def start_two_rank_extraction(pretrained: Path, out: Path, chunk: int) -> Tuple[List[str], subprocess.Popen]:
    """(the arguments, the running tool) of a two-rank extraction of the digits' TRAIN split into
    ``out`` in chunks of ``chunk`` samples, for tests that signal or kill it on its way."""
    import sys

    from conftest import TOOL, tool_env

    args = ["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={pretrained}",
            f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]",
            f"config.EXTRACT_FEATURES.CHUNK_THRESHOLD={chunk}", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
            "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]
    proc = subprocess.Popen([sys.executable, TOOL, *args], cwd=str(REPO), env=tool_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return args, proc


def test_a_preemption_signal_stops_extraction_and_the_rerun_completes(pretrained: Path, tmp_path: Path) -> None:
    """SIGTERM in the middle of a split: exit 3 at the next batch, complete shards only, the split
    marked unfinished (readers refuse it); the same command then extracts it in full. Two ranks:
    the launcher forwards the signal, each rank stops on its own flag and reports code 3."""
    import signal
    import time

    out = tmp_path / "out"
    args, proc = start_two_rank_extraction(pretrained, out, chunk=32)
    deadline = time.time() + 240
    while not list(out.glob("rank0_chunk0_train_*inds.npy")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the extraction ended before the signal"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 3, stderr[-3000:]
    assert "preemption" in stderr + stdout and "Traceback" not in stderr, stderr[-3000:]
    assert extraction_status(out, "TRAIN")["status"] == "running"
    with pytest.raises(FeatureShardError):
        load_features(out, "train", "res5avg")
    written = sorted(out.glob("rank*_train_res5avg_inds.npy"))
    assert written and sum(len(np.load(p)) for p in written) < 1000, "the extraction ran to its end"
    assert temp_files(out) == []
    tool(args)
    n = extraction_status(out, "TRAIN")["samples"]
    np.testing.assert_array_equal(load_features(out, "train", "res5avg")["inds"], np.arange(n))


def test_a_rank_killed_mid_shard_leaves_no_temp_file_or_lock_in_the_feature_folder(pretrained: Path,
                                                                                  tmp_path: Path) -> None:
    """SIGKILL of rank 0 (the OOM killer) while it writes a chunk into EXTRACT_FEATURES.OUTPUT_DIR:
    the launcher removed a killed rank's temporary files and lock from CHECKPOINT.DIR only, so
    its half-written shards and extract.lock stayed in the feature folder (the next extraction
    took the lock over with a warning). The feature folder is cleaned as the checkpoint folder is."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    _, proc = start_two_rank_extraction(pretrained, out, chunk=64)
    deadline = time.time() + 240
    writing: List[Path] = []
    while not writing and proc.poll() is None and time.time() < deadline:
        writing = list(out.glob(".rank0_chunk*_train_*.tmp.*")) if out.is_dir() else []
        time.sleep(0.02)
    assert writing, "rank 0 wrote no chunk before the extraction ended"
    os.kill(int(writing[0].name.rsplit(".", 1)[1]), signal.SIGKILL)  # the rank that writes it
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "rank 0 was killed by SIGKILL" in stderr, stderr[-3000:]
    assert temp_files(out) == [] and not (out / "extract.lock").exists(), sorted(os.listdir(out))
    assert extraction_status(out, "TRAIN")["status"] == "running"


@pytest.mark.parametrize("asked, other", [("TRAIN", "TEST"), ("TEST", "TRAIN")])
def test_extraction_checks_and_builds_only_the_splits_it_is_asked_for(tmp_path: Path, asked: str, other: str) -> None:
    # the split left out names data that is not on this machine, a path count that does not fit
    # its sources and an unknown transform: none of it may stop extracting the split asked for
    proc = tool(["config=quick/simclr_synthetic", "engine_name=extract_features", f"config.CHECKPOINT.DIR={tmp_path}",
                 f"config.EXTRACT_FEATURES.SPLITS=[{asked}]", f"config.DATA.{asked}.DATA_SOURCES=[synthetic]",
                 f"config.DATA.{asked}.LABEL_SOURCES=[synthetic]", f"config.DATA.{asked}.DATA_LIMIT=8",
                 f"config.DATA.{asked}.BATCHSIZE_PER_REPLICA=4", f"config.DATA.{asked}.COLLATE_FUNCTION=default_collate",
                 f"config.DATA.{asked}.TRANSFORMS=[{{name: ToTensor}}]",
                 f"config.DATA.{other}.DATA_SOURCES=[disk_folder,disk_folder]",
                 f"config.DATA.{other}.DATA_PATHS=[{tmp_path / 'not_here'}]",
                 f"config.DATA.{other}.TRANSFORMS=[{{name: NoSuchTransform}}]",
                 # nor may what only training needs: an lr schedule that does not fit 2 epochs
                 "config.OPTIMIZER.param_schedulers.lr.name=multistep",
                 "config.OPTIMIZER.param_schedulers.lr.values=[0.1,0.01]",
                 "config.OPTIMIZER.param_schedulers.lr.milestones=[30]"])
    assert available(tmp_path) == [(asked.lower(), "heads")], proc.stdout[-2000:]
    assert extraction_status(tmp_path, asked)["samples"] == 8


def test_a_model_without_heads_writes_its_output_as_heads(tmp_path: Path) -> None:
    # VISSL names the model's output "heads" whatever it holds: scripts that read "heads" must find
    # the trunk's features of a model without heads; EXTRACT_TRUNK_FEATURES_ONLY names the layer
    base = ["config=quick/simclr_synthetic", "engine_name=extract_features", "config.MODEL.HEAD.PARAMS=[]",
            "config.EXTRACT_FEATURES.SPLITS=[TRAIN]", "config.DATA.TRAIN.DATA_LIMIT=6",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.TRAIN.COLLATE_FUNCTION=default_collate",
            "config.DATA.TRAIN.TRANSFORMS=[{name: ToTensor}]"]
    tool([*base, f"config.CHECKPOINT.DIR={tmp_path / 'out'}"])
    assert available(tmp_path / "out") == [("train", "heads")]
    feats = load_features(tmp_path / "out", "train", "heads")
    assert feats["features"].shape[0] == 6 and feats["features"].ndim == 2
    tool([*base, f"config.CHECKPOINT.DIR={tmp_path / 'trunk'}",
          "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
          "config.MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY=true"])
    [(split, layer)] = available(tmp_path / "trunk")
    assert split == "train" and layer != "heads"
    np.testing.assert_array_equal(load_features(tmp_path / "trunk", "train", layer)["features"], feats["features"])


def test_a_pool_op_larger_than_its_layer_is_one_line_before_launch(tmp_path: Path) -> None:
    # VISSL's maps are sized for 224x224 crops: AvgPool2d 6x6 on res4 of a 32x32 image (2x2) cannot run
    big_pool = "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[res4,[AvgPool2d,[[6,6],1,0]]]]"
    common = ["config=quick/simclr_synthetic", "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
              "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_ONLY=true", big_pool,
              "config.DATA.TRAIN.COLLATE_FUNCTION=default_collate", "config.DATA.TRAIN.TRANSFORMS=[{name: ToTensor}]",
              "config.DATA.TRAIN.DATA_LIMIT=8", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4"]
    must = ("config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP[0]", "AvgPool2d", "'res4' of [256, 2, 2]",
            "input images 32x32")
    out = tmp_path / "extract"
    proc = tool([*common, "engine_name=extract_features", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]",
                 "config.MODEL.FEATURE_EVAL_SETTINGS.EXTRACT_TRUNK_FEATURES_ONLY=true", f"config.CHECKPOINT.DIR={out}"],
                ok=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert all(text in err for text in must), err
    assert not out.exists()  # found on the meta device before launch: nothing was written
    # the same map in a linear evaluation: the same line, before launch too
    proc = tool([*common, f"config.CHECKPOINT.DIR={tmp_path / 'train'}", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[256,10]}]]",
                 "config.LOSS.name=cross_entropy_multiple_output_single_target"], ok=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert all(text in err for text in must), err


def test_linear_eval_trains_heads_on_a_frozen_pretrained_trunk(pretrained: Path, tmp_path: Path) -> None:
    params_file = pretrained / "checkpoint.torch"
    tool(["config=benchmark/linear_eval_digits_resnet", f"config.CHECKPOINT.DIR={tmp_path}",
          f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={params_file}", "config.OPTIMIZER.num_epochs=1",
          "config.OPTIMIZER.param_schedulers.lr.name=constant", "config.OPTIMIZER.param_schedulers.lr.value=0.05",
          "config.DATA.TRAIN.DATA_LIMIT=128", "config.DATA.TEST.DATA_LIMIT=64"])
    import json

    metrics = [json.loads(l) for l in (tmp_path / "metrics.json").read_text().splitlines()]
    test = [m for m in metrics if "test_accuracy_list_meter" in m]
    assert test, metrics
    top1 = test[-1]["test_accuracy_list_meter"]["top_1"]
    assert set(top1) == {"res3", "res4", "res5avg"}
    assert all(0.0 <= v <= 100.0 for v in top1.values())
    before = load_checkpoint(params_file)["classy_state_dict"]["base_model"]["model"]["trunk"]
    after_ckpt = load_checkpoint(tmp_path / "checkpoint.torch")["classy_state_dict"]["base_model"]["model"]
    after = after_ckpt["trunk"]
    assert set(before) == set(after)
    for name, tensor in before.items():
        if not name.endswith("num_batches_tracked"):
            assert torch.equal(tensor, after[name]), name  # weights and BN statistics unchanged
    assert any(k.startswith("0.") for k in after_ckpt["heads"]) and any(k.startswith("2.") for k in after_ckpt["heads"])


@pytest.mark.gpu
def test_extraction_on_gpu_matches_cpu(pretrained: Path, one_rank, tmp_path: Path) -> None:
    # cuDNN runs float32 convolutions in TF32 on Ampere and newer GPUs by default (10-bit
    # mantissa: elements off by a few 1e-3 after a resnet); switched off, float32 must match
    proc = run_tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={pretrained}",
                     "config.MACHINE.DEVICE=gpu", f"config.EXTRACT_FEATURES.OUTPUT_DIR={tmp_path}",
                     "config.EXTRACT_FEATURES.SPLITS=[TEST]", *DIGITS_SMALL], env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = load_features(one_rank["folder"], "test", "res5avg")["features"]
    b = load_features(tmp_path, "test", "res5avg")["features"]
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def test_every_split_is_built_before_the_first_is_extracted(tmp_path: Path, monkeypatch) -> None:
    # a data set that fails to build on a rank (an unreadable list on that node, say) must stop the
    # extraction before any split's shards or status are written, not after hours of TRAIN
    import ssl_engine.data as data
    from ssl_engine.config import compose
    from ssl_engine.distributed import RankInfo
    from ssl_engine.engines.extract_features import extract_features_engine
    from ssl_engine.engines.run import load_builtin_parts

    load_builtin_parts()
    cfg = compose(["config=quick/simclr_synthetic", "engine_name=extract_features",
                   f"config.CHECKPOINT.DIR={tmp_path}", "config.EXTRACT_FEATURES.SPLITS=[TRAIN,TEST]",
                   *[f"config.DATA.{s}.{k}" for s in ("TRAIN", "TEST") for k in (
                       "DATA_SOURCES=[synthetic]", "LABEL_SOURCES=[synthetic]", "DATA_LIMIT=8",
                       "BATCHSIZE_PER_REPLICA=4", "COLLATE_FUNCTION=default_collate", "TRANSFORMS=[{name: ToTensor}]")]],
                  warn_unused=False)
    build = data.build_dataset

    def unreadable_test_split(cfg, split, *args, **kwargs):
        if split == "TEST":
            raise UserError("config.DATA.TEST.DATA_PATHS[0]: cannot read the file list on this node")
        return build(cfg, split, *args, **kwargs)

    monkeypatch.setattr(data, "build_dataset", unreadable_test_split)
    with pytest.raises(UserError, match="cannot read the file list"):
        extract_features_engine(cfg, RankInfo())
    assert available(tmp_path) == [] and not list(tmp_path.glob("extraction_*.json"))
    monkeypatch.setattr(data, "build_dataset", build)
    extract_features_engine(cfg, RankInfo())
    assert available(tmp_path) == [("test", "heads"), ("train", "heads")]
    assert [extraction_status(tmp_path, s)["samples"] for s in ("TRAIN", "TEST")] == [8, 8]


def test_a_folder_whose_checkpoints_are_all_damaged_is_not_extracted_as_a_random_model(pretrained: Path,
                                                                                       tmp_path: Path) -> None:
    # random init is for a folder without checkpoints; a trained run whose files are all damaged
    # must stop in one line, not write a random model's features marked complete
    import shutil

    damaged = tmp_path / "run"
    shutil.copytree(pretrained, damaged, symlinks=True)
    for p in damaged.glob("model_*.torch"):
        p.write_bytes(p.read_bytes()[:10000])
    out = tmp_path / "out"
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={damaged}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}", "config.EXTRACT_FEATURES.SPLITS=[TEST]", *DIGITS_SMALL],
                ok=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1].startswith("error: "), proc.stderr[-3000:]
    assert f"config.CHECKPOINT.DIR {damaged}: none of its checkpoints can be used (model_final" in err[-1]
    assert "randomly initialised model (seed" not in proc.stdout + proc.stderr
    assert not out.exists() or available(out) == []


@pytest.mark.parametrize("damage,named", [
    ("dangling pointer", "checkpoint.torch (a link to nothing)"),
    ("pointer loop", "checkpoint.torch (a link to nothing)"),
    ("unreadable copy", "checkpoint.torch"),
    ("folder", "model_phase0.torch (a folder)"),
])
def test_a_folder_whose_only_checkpoint_entry_is_unusable_is_not_extracted_as_a_random_model(
        tmp_path: Path, damage: str, named: str) -> None:
    """A CHECKPOINT.DIR whose checkpoint.torch leads nowhere (the files it named were deleted), or
    holds what no checkpoint holds (VISSL keeps a copy there, not a link), or a folder under a
    checkpoint's name: the extraction wrote a random model's features, marked complete (exit 0),
    as for a folder without checkpoints. Now the one line of a folder whose checkpoints are all
    damaged, naming the entry."""
    run = tmp_path / "run"
    run.mkdir()
    if damage == "dangling pointer":
        (run / "checkpoint.torch").symlink_to("model_phase3.torch")
    elif damage == "pointer loop":
        (run / "checkpoint.torch").symlink_to("checkpoint.torch")
    elif damage == "unreadable copy":
        torch.save([1, 2], run / "checkpoint.torch")
    else:
        (run / "model_phase0.torch").mkdir()
    out = tmp_path / "out"
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={run}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}", "config.EXTRACT_FEATURES.SPLITS=[TEST]", *DIGITS_SMALL],
                ok=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert err[-1].startswith(f"error: config.CHECKPOINT.DIR {run}: none of its checkpoints can be used ({named}; "), err[-1]
    assert "randomly initialised model (seed" not in proc.stdout + proc.stderr
    assert not out.exists() or available(out) == []


def test_trunk_features_of_a_training_folder_load_its_trunk_whatever_the_configs_heads(pretrained: Path, one_rank,
                                                                                     tmp_path: Path) -> None:
    # EXTRACT_TRUNK_FEATURES_ONLY needs the trunk's weights only: a config whose head differs from
    # the training's (another projection size) extracts the same features; where the heads' output
    # is extracted, a head that does not fit is one line naming the file and an extraction's way out
    out = tmp_path / "trunk"
    tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={pretrained}", f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}",
          "config.EXTRACT_FEATURES.SPLITS=[TEST]", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,64]}]]", *DIGITS_SMALL])
    np.testing.assert_allclose(load_features(out, "test", "res5avg")["features"],
                               load_features(one_rank["folder"], "test", "res5avg")["features"], rtol=1e-4, atol=1e-5)
    proc = tool(["config=quick/simclr_digits", "engine_name=extract_features", f"config.CHECKPOINT.DIR={pretrained}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={tmp_path / 'heads'}", "config.EXTRACT_FEATURES.SPLITS=[TEST]",
                 "config.DATA.TEST.TRANSFORMS=[{name: ToTensor}]", "config.DATA.TEST.COLLATE_FUNCTION=default_collate",
                 "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,64]}]]", *DIGITS_SMALL], ok=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1].startswith("error: "), proc.stderr[-3000:]
    assert str(pretrained) in err[-1] and "do not fit this model" in err[-1] and "WEIGHTS_INIT.PARAMS_FILE" in err[-1]
    assert "AUTO_RESUME" not in err[-1]


def _color_folders(root: Path, classes: Dict[str, str]) -> None:
    """``{split: class letters}``: 2 images per class, one color per class (a red, b green, c blue)."""
    from PIL import Image

    colors = {"a": (200, 0, 0), "b": (0, 200, 0), "c": (0, 0, 200), "d": (200, 200, 0)}
    for split, letters in classes.items():
        for c in letters:
            (root / split / c).mkdir(parents=True)
            for i in range(2):
                r, g, b = colors[c]
                Image.new("RGB", (8, 8), (r, g + 7 * i, b)).save(root / split / c / f"{i}.png")


def test_knn_compares_class_folders_by_name_when_the_test_folder_lacks_a_class(tmp_path: Path) -> None:
    # each split numbers its own sorted class folders (VISSL's numbering, kept in the shards): the
    # test folder's c is 1, the train folder's c is 2; the kNN test renumbers the test labels by name
    _color_folders(tmp_path, {"train": "abc", "test": "ac"})
    args = ["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path / 'out'}",
            "config.NEAREST_NEIGHBOR.TOPK=1", "config.MODEL.TRUNK.NAME=mlp", "config.MODEL.TRUNK.MLP.DIMS=[192,32]",
            "config.MODEL.HEAD.PARAMS=[]", "config.DATA.TRAIN.COLLATE_FUNCTION=default_collate",
            "config.DATA.TRAIN.DATA_LIMIT=-1", "config.DATA.TRAIN.DROP_LAST=false"]
    for split in ("TRAIN", "TEST"):
        args += [f"config.DATA.{split}.DATA_SOURCES=[disk_folder]", f"config.DATA.{split}.LABEL_SOURCES=[disk_folder]",
                 f"config.DATA.{split}.DATA_PATHS=[{tmp_path / split.lower()}]",
                 f"config.DATA.{split}.TRANSFORMS=[{{name: ToTensor}}]", f"config.DATA.{split}.BATCHSIZE_PER_REPLICA=2"]
    proc = tool(args, script=NN_TOOL)
    # the shards keep each folder's own ids; the status files say which names they stand for
    assert extraction_status(tmp_path / "out", "test")["classes"] == ["a", "c"]
    assert load_features(tmp_path / "out", "test", "heads")["targets"].reshape(-1).tolist() == [0, 0, 1, 1]
    assert "numbered as the train split's 3 by name (no test images of: b)" in proc.stdout
    # each test image has its twin in the train folder: every nearest neighbour is of its class
    assert "top-1 100.00%" in [l for l in proc.stdout.splitlines() if l.startswith("kNN heads")][0], proc.stdout

    # VISSL's extraction configs set TRAIN.LABEL_TYPE: sample_index: such targets are no classes,
    # which the kNN tool says before it extracts anything ...
    proc = tool([*args, f"config.CHECKPOINT.DIR={tmp_path / 'idx'}", "config.DATA.TRAIN.LABEL_TYPE=sample_index"],
                script=NN_TOOL, ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the kNN test compares class labels, but config.DATA.TRAIN.LABEL_TYPE=sample_index gives the features "
        "sample indices as targets; set config.DATA.TRAIN.LABEL_TYPE=standard")
    assert not (tmp_path / "idx").exists() or not list((tmp_path / "idx").glob("*.npy"))
    # ... and of features extracted that way elsewhere, when it reads them
    tool(["engine_name=extract_features", *args, f"config.CHECKPOINT.DIR={tmp_path / 'idx'}",
          "config.DATA.TRAIN.LABEL_TYPE=sample_index"])
    assert "classes" not in extraction_status(tmp_path / "idx", "train")  # no class names for sample indices
    proc = tool([*args, f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path / 'idx'}"], script=NN_TOOL, ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "extracted with config.DATA.TRAIN.LABEL_TYPE=sample_index, so their targets are sample indices" in \
        proc.stderr.strip().splitlines()[-1]

    # a test split whose extraction was stopped is named as such, not as "no layer with test features"
    write_extraction_status(tmp_path / "out", "test", "running")  # killed before its first shard
    remove_shards(tmp_path / "out", "test")
    proc = tool([*args, f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path / 'out'}"], script=NN_TOOL, ok=False)
    assert proc.returncode == 2
    assert "the test extraction in" in proc.stderr and "did not finish" in proc.stderr, proc.stderr


def test_align_test_labels_renumbers_a_subset_by_name_and_leaves_other_classes_as_they_are() -> None:
    from ssl_engine.knn import align_test_labels

    same, note = align_test_labels(["a", "b"], ["a", "b"], np.array([0, 1]))
    assert same.tolist() == [0, 1] and note is None
    y, note = align_test_labels(["a", "b", "c"], ["a", "c"], np.array([[0, 5], [1, 6], [-1, 7]]))
    assert y.tolist() == [[0, 5], [2, 6], [-1, 7]] and "no test images of: b" in note  # first column only; -1 stays
    kept, note = align_test_labels(["a", "b"], ["a", "x"], np.array([0, 1]))
    assert kept.tolist() == [0, 1] and "'x'" in note and "compared by their ids" in note
    assert align_test_labels(None, ["a"], np.array([0]))[1] is None  # shards written by VISSL: nothing to compare


HOLD_EXTRACT = ("from ssl_engine.lock import FolderLock, EXTRACT_LOCK_NAME; import sys, time; "
                "l = FolderLock(sys.argv[1], EXTRACT_LOCK_NAME); l.acquire(); print('held', flush=True); time.sleep(60)")


def test_a_second_extraction_into_a_folder_in_use_is_refused_naming_the_first(pretrained: Path, tmp_path: Path) -> None:
    """Two extractions into one folder would remove and mix each other's shards (of two models):
    the second is refused by name, before it touches a file; a finished one leaves no lock."""
    import os
    import socket
    import sys

    from conftest import tool_env

    out = tmp_path / "features"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={pretrained}",
            f"config.EXTRACT_FEATURES.OUTPUT_DIR={out}", *DIGITS_SMALL]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_EXTRACT, str(out)], stdout=subprocess.PIPE, text=True,
                              env=tool_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = tool(args, ok=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: feature folder {out} is in use by another feature extraction (pid {holder.pid} on host "
            f"{socket.gethostname()}, started " + proc.stderr.split("started ", 1)[1].split(";")[0]
            + f"; lock file {out / 'extract.lock'}); wait for it to end or use another "
            f"config.EXTRACT_FEATURES.OUTPUT_DIR")
        assert sorted(os.listdir(out)) == ["extract.lock", "keep.txt"]
    finally:
        holder.kill()
        holder.wait()
    tool(args)  # the holder is gone: its lock is stale and taken over
    assert not (out / "extract.lock").exists()
    assert (out / "extraction_train.json").exists() and (out / "keep.txt").exists()


def test_knn_on_features_with_nan_rows_is_one_line_naming_the_split(tmp_path: Path, capsys) -> None:
    """Features of a diverged model hold NaN: the kNN tool says so (exit 2) instead of printing an
    accuracy computed from rows that rank nowhere."""
    for split, n in (("TRAIN", 12), ("TEST", 6)):
        writer = ShardWriter(tmp_path, 0, split, 0)
        feats = np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32)
        if split == "TRAIN":
            feats[[3, 7], 1] = np.nan
        writer.add({"res5avg": feats}, np.arange(n) % 3, np.arange(n))
        writer.close()
        write_extraction_status(tmp_path, split, "complete", samples=n, label_type="standard")
    spec = importlib.util.spec_from_file_location("nearest_neighbor_test", NN_TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = mod.main(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == (
        f"error: kNN res5avg in {tmp_path}: 2 of 12 train features hold NaN or inf values (the first is row 3); the model that gave them does "
        "not compute finite outputs (did its training diverge?), so no neighbour can be ranked: extract them again "
        "from finite weights"), err
    # the same check on the test side, chunk by chunk
    train = np.ones((4, 2), np.float32)
    test = np.ones((5, 2), np.float32)
    test[4, 0] = np.inf
    with pytest.raises(UserError, match=r"1 of 5 test features hold NaN or inf values \(the first is row 4\)"):
        knn_accuracy(train, np.zeros(4, int), test, np.zeros(5, int), chunk_size=2)


def test_an_unreadable_image_is_left_out_of_the_features_not_replaced_under_its_index(tmp_path: Path) -> None:
    """ON_CORRUPT_IMAGE: skip trains on the next readable image in place of a broken one; an
    extraction would write that image's features and label under the broken sample's index (a
    mislabelled kNN set). It leaves the row out, names the index in the log and in the status."""
    _color_folders(tmp_path, {"train": "abc"})
    (tmp_path / "train" / "a" / "1.png").write_text("not an image")  # sample 1 (a/0, a/1, b/0, ...)
    out = tmp_path / "out"
    args = ["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={out}", "--engine=extract_features",
            "config.MODEL.TRUNK.NAME=mlp", "config.MODEL.TRUNK.MLP.DIMS=[192,32]", "config.MODEL.HEAD.PARAMS=[]",
            "config.EXTRACT_FEATURES.SPLITS=[TRAIN]", "config.DATA.TRAIN.COLLATE_FUNCTION=default_collate",
            "config.DATA.TRAIN.DATA_LIMIT=-1", "config.DATA.TRAIN.DROP_LAST=false",
            "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]",
            f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'train'}]", "config.DATA.TRAIN.TRANSFORMS=[{name: ToTensor}]",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4", "config.DATA.NUM_DATALOADER_WORKERS=0"]
    proc = tool(args)
    assert "1 unreadable TRAIN image(s) left out of the features (sample indices 1;" in proc.stdout + proc.stderr
    feats = load_features(out, "train", "heads")
    assert feats["inds"].reshape(-1).tolist() == [0, 2, 3, 4, 5]
    assert feats["targets"].reshape(-1).tolist() == [0, 1, 1, 2, 2]
    status = extraction_status(out, "train")
    assert status["samples"] == 5 and status["unreadable"] == [1]


def test_a_garbled_shard_or_a_folder_for_a_status_file_is_one_line_that_does_not_invite_unsafe_loading(
        tmp_path: Path) -> None:
    write_split(tmp_path, "TRAIN", np.arange(10))
    write_extraction_status(tmp_path, "TRAIN", "complete", samples=10)
    shard = next(tmp_path.glob("rank0_chunk0_train_res5avg_features.npy"))
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)  # no .npy header: numpy's error suggests allow_pickle=True, which would unpickle the file
    shard.write_bytes(bytes(data))
    with pytest.raises(FeatureShardError) as e:
        load_features(tmp_path, "train", "res5avg")
    assert str(e.value).endswith("its header is damaged (it does not describe a numeric array); extract again")
    status_path(tmp_path, "TRAIN").unlink()
    status_path(tmp_path, "TRAIN").mkdir()
    with pytest.raises(FeatureShardError, match=r"is not a status file of this engine \(not a readable file\)"):
        extraction_status(tmp_path, "train")


def test_an_extraction_that_fails_while_running_marks_its_split_failed(tmp_path: Path) -> None:
    """An error inside the extraction (here two views per sample, which the collator gives and
    only the first batch shows) is one line, and the split's status says failed and why, so that
    a reader names it instead of reading a half-written split."""
    out = tmp_path / "extract"
    proc = tool(["config=quick/simclr_synthetic", "engine_name=extract_features", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]",
                 f"config.CHECKPOINT.DIR={out}", "config.DATA.TRAIN.DATA_LIMIT=8",
                 "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4"], ok=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    status = extraction_status(out, "TRAIN")
    assert status["status"] == "failed" and "2 inputs per sample" in status["error"], status
    with pytest.raises(FeatureShardError, match="failed .*2 inputs per sample"):
        load_features(out, "train", "heads")



def test_knn_on_a_folder_names_the_layer_and_folder_of_features_that_do_not_match(tmp_path: Path) -> None:
    """Shards without status files (VISSL's) whose train and test features have other dims: the
    one line names the layer and the folder (a folder may hold several layers), not just the dims."""
    from ssl_engine.errors import UserError
    from ssl_engine.knn import knn_on_folder

    for split, dim in (("train", 32), ("test", 16)):
        np.save(shard_path(tmp_path, 0, 0, split, "fc1", "features"), np.ones((4, dim), dtype=np.float32))
        np.save(shard_path(tmp_path, 0, 0, split, "fc1", "targets"), np.array([0, 1, 0, 1]))
        np.save(shard_path(tmp_path, 0, 0, split, "fc1", "inds"), np.arange(4))
    with pytest.raises(UserError, match=f"^kNN fc1 in {tmp_path}: train features have dim 32 but test features have dim 16$"):
        knn_on_folder(tmp_path, "fc1", topk=1)


# ------------------------------------------------------------------------------- VISSL's own shards


def write_vissl_shards(folder: Path, split: str, layer: str, features: np.ndarray, labels: np.ndarray, ranks: int,
                       chunked: bool = True, stale: float = 0.0) -> None:
    """Shards as VISSL's extraction wrote them on ``ranks`` GPUs: its sampler padded the shares to
    one length with samples from the start of the split (rank r takes positions r, r + ranks, ...),
    targets are [n, 1], no status file. The padded copies' features get ``stale`` added (on a GPU
    another batch can give other last digits)."""
    n = len(features)
    order = list(range(n)) + list(range(-n % ranks))  # the padding: the first samples again
    for r in range(ranks):
        inds = np.asarray(order[r::ranks], dtype=np.int64)
        padded = np.arange(len(inds)) >= len(range(r, n, ranks))
        feats = features[inds] + stale * padded[:, None]
        stem = f"rank{r}_chunk0_{split}_{layer}" if chunked else f"rank{r}_{split}_{layer}"
        np.save(folder / f"{stem}_features.npy", feats.astype(np.float32))
        np.save(folder / f"{stem}_targets.npy", labels[inds].reshape(-1, 1))
        np.save(folder / f"{stem}_inds.npy", inds)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "chunk-less"])
def test_vissl_shards_with_its_sampler_padding_are_read_once_per_sample(tmp_path: Path, chunked: bool) -> None:
    """VISSL's multi-GPU extraction repeats up to ranks - 1 samples (its sampler's padding): each is
    read once, from its own rank's share; older VISSL wrote one chunk-less shard per rank (was:
    both refused, "sample index 0 appears more than once" and "no feature shards")."""
    feats = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    labels = np.arange(10) % 4
    write_vissl_shards(tmp_path, "train", "res5", feats, labels, ranks=4, chunked=chunked, stale=0.5)
    assert available(tmp_path) == [("train", "res5")]
    got = load_features(tmp_path, "train", "res5")
    assert got["inds"].tolist() == list(range(10))
    np.testing.assert_array_equal(got["features"], feats)  # the samples' own rows, not the padded copies
    assert got["targets"].reshape(-1).tolist() == labels.tolist()
    shards = list(iter_shards(tmp_path, "train", "res5"))
    assert [s.rank for s in shards] == [0, 1, 2, 3] and {s.chunk for s in shards} == {0}
    assert sorted(i for s in shards for i in s.inds.tolist()) == list(range(10))
    np.testing.assert_array_equal(np.concatenate([s.features for s in shards])[np.argsort(
        np.concatenate([s.inds for s in shards]))], feats)
    assert shards[1].name == ("rank1_chunk0_train_res5" if chunked else "rank1_train_res5")
    # the padded copy is the last row of its shard: the rest stays memory-mapped
    assert isinstance(shards[3].features, np.memmap) and len(shards[3].inds) == 2


def test_a_vissl_shard_of_padding_copies_only_is_given_empty(tmp_path: Path) -> None:
    """5 samples on 2 ranks in chunks of 2: rank 1's last chunk holds only the padding copy of
    sample 0 (was: iter_shards gave three shards, then an IndexError)."""
    for rank, chunks in ((0, [[0, 2], [4]]), (1, [[1, 3], [0]])):
        for c, inds in enumerate(chunks):
            np.save(shard_path(tmp_path, rank, c, "train", "l", "features"), np.asarray(inds, np.float32)[:, None])
            np.save(shard_path(tmp_path, rank, c, "train", "l", "targets"), np.zeros(len(inds), np.int64))
            np.save(shard_path(tmp_path, rank, c, "train", "l", "inds"), np.asarray(inds, np.int64))
    shards = list(iter_shards(tmp_path, "train", "l"))
    assert [(s.rank, s.chunk, s.inds.tolist()) for s in shards] == [(0, 0, [0, 2]), (0, 1, [4]), (1, 0, [1, 3]), (1, 1, [])]
    assert shards[3].features.shape == (0, 1)
    assert load_features(tmp_path, "train", "l")["features"][:, 0].tolist() == [0, 1, 2, 3, 4]


def test_vissl_padding_beside_an_empty_shard_reads(tmp_path: Path) -> None:
    """A shard of no rows (a third-party or edited folder) in a folder with padding repeats (was:
    a traceback, "cannot reshape array of size 0")."""
    feats = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    write_vissl_shards(tmp_path, "train", "res5", feats, np.arange(10) % 4, ranks=4)
    np.save(tmp_path / "rank2_chunk1_train_res5_features.npy", np.zeros((0, 3), np.float32))
    np.save(tmp_path / "rank2_chunk1_train_res5_targets.npy", np.zeros((0, 1), np.int64))
    np.save(tmp_path / "rank2_chunk1_train_res5_inds.npy", np.zeros(0, np.int64))
    np.testing.assert_array_equal(load_features(tmp_path, "train", "res5")["features"], feats)
    assert sum(len(s.inds) for s in iter_shards(tmp_path, "train", "res5")) == 10


def test_iter_shards_checks_a_folder_without_status_file_as_load_features_does(tmp_path: Path) -> None:
    """Without a status file (VISSL's shards) the streaming reader used to give shards of other
    shapes, or a split with indices missing, as they were; it refuses them as load_features does."""
    def shard(folder: Path, rank: int, inds, dim: int = 2, target_cols: int = 0) -> None:
        folder.mkdir(exist_ok=True)
        stem = folder / f"rank{rank}_chunk0_train_l"
        np.save(f"{stem}_features.npy", np.zeros((len(inds), dim), np.float32))
        np.save(f"{stem}_targets.npy", np.zeros((len(inds), target_cols) if target_cols else len(inds), np.int64))
        np.save(f"{stem}_inds.npy", np.asarray(inds, np.int64))

    shard(tmp_path / "dims", 0, [0, 2, 4])
    shard(tmp_path / "dims", 1, [1, 3], dim=5)
    shard(tmp_path / "gap", 0, [0, 2, 4])
    shard(tmp_path / "gap", 1, [1])
    shard(tmp_path / "targets", 0, [0, 2, 4])
    shard(tmp_path / "targets", 1, [1, 3, 0], target_cols=2)
    shard(tmp_path / "in_rank", 0, [0, 2, 4, 2])
    shard(tmp_path / "in_rank", 1, [1, 3])
    for name, says in (("dims", "rank1_chunk0_train_l has features \\(5,\\)"),
                       ("gap", "4 samples but indices run from 0 to 4; 1 are missing"),
                       ("targets", "rank1_chunk0_train_l has features \\(2,\\) and targets \\(2,\\)"),
                       ("in_rank", "sample index 2 appears twice in the shards of rank 0")):
        with pytest.raises(FeatureShardError, match=says):
            next(iter_shards(tmp_path / name, "train", "l"))
        with pytest.raises(FeatureShardError, match=says):
            load_features(tmp_path / name, "train", "l")


def test_repeats_beyond_vissl_padding_or_in_this_engines_shards_are_refused(tmp_path: Path) -> None:
    feats = np.ones((10, 3), dtype=np.float32)
    labels = np.arange(10) % 4
    # 2 ranks pad at most 1 sample: a third shard repeating half the split is two extractions mixed
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_vissl_shards(mixed, "train", "res5", feats, labels, ranks=2)
    np.save(mixed / "rank2_chunk0_train_res5_features.npy", feats[:5])
    np.save(mixed / "rank2_chunk0_train_res5_targets.npy", labels[:5].reshape(-1, 1))
    np.save(mixed / "rank2_chunk0_train_res5_inds.npy", np.arange(5))
    with pytest.raises(FeatureShardError, match=r"sample index 0 appears more than once \(5 repeats\); shards of two"):
        load_features(mixed, "train", "res5")
    with pytest.raises(FeatureShardError, match=r"\(5 repeats\)"):
        next(iter_shards(mixed, "train", "res5"))
    # a padded copy whose target is not its sample's
    other = tmp_path / "other"
    other.mkdir()
    write_vissl_shards(other, "train", "res5", feats, labels, ranks=3)
    assert len(load_features(other, "train", "res5")["inds"]) == 10
    np.save(other / "rank2_chunk0_train_res5_targets.npy", np.full((4, 1), 3))
    with pytest.raises(FeatureShardError, match="sample index 1 appears twice with different targets"):
        load_features(other, "train", "res5")
    # this engine's own shards (a status file) never repeat an index: one repeat is refused
    write_vissl_shards(other, "test", "res5", feats, labels, ranks=3)
    write_extraction_status(other, "test", "complete", samples=12)
    with pytest.raises(FeatureShardError, match=r"sample index 0 appears more than once \(2 repeats\)"):
        load_features(other, "test", "res5")
    with pytest.raises(FeatureShardError, match=r"\(2 repeats\)"):
        next(iter_shards(other, "test", "res5"))


def test_chunkless_and_chunked_shards_of_one_layer_are_refused_as_two_extractions(tmp_path: Path) -> None:
    feats = np.ones((6, 2), dtype=np.float32)
    write_vissl_shards(tmp_path, "train", "res5", feats, np.zeros(6, np.int64), ranks=2, chunked=False)
    write_vissl_shards(tmp_path, "train", "res5", feats, np.zeros(6, np.int64), ranks=1, chunked=True)
    with pytest.raises(FeatureShardError, match=r"has chunk-less shards \(rank0_train_res5_\*, VISSL's older naming\) "
                                                r"and chunked ones .*two extractions are mixed"):
        load_features(tmp_path, "train", "res5")
    # a new extraction into the folder removes both namings of its split
    assert remove_shards(tmp_path, "train") == 9
    assert available(tmp_path) == []


def test_knn_tool_reads_a_vissl_feature_folder_with_padded_shards(tmp_path: Path) -> None:
    """The kNN tool on features a VISSL user extracted on 3 GPUs (older chunk-less naming, the
    sampler's padding repeated): each sample counts once."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    write_vissl_shards(tmp_path, "train", "heads", x[:1000], y[:1000], ranks=3, chunked=False)
    write_vissl_shards(tmp_path, "test", "heads", x[1000:1400], y[1000:1400], ranks=3, chunked=False)
    proc = tool(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}",
                 "config.NEAREST_NEIGHBOR.TOPK=5"], script=NN_TOOL)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("kNN heads")]
    assert len(line) == 1 and "1000 train / 400 test, dim 64" in line[0], proc.stdout[-2000:]
    top1 = float(re.search(r"top-1 ([0-9.]+)%", line[0])[1])
    assert top1 > 90.0, line[0]  # raw digits pixels: a 5-NN classifies them well


def test_knn_tool_on_a_vissl_folder_with_an_empty_test_split_is_one_line(tmp_path: Path) -> None:
    """VISSL shards of a split that holds 0 samples: load_features gives [0, D] rows (reshaping to
    (0, -1) raised numpy's ValueError, a traceback from the kNN tool), and the tool says that the
    test split is empty, exit 2."""
    for split, n in (("train", 6), ("test", 0)):
        np.save(tmp_path / f"rank0_{split}_heads_features.npy", np.ones((n, 2, 1, 1), dtype=np.float32))
        np.save(tmp_path / f"rank0_{split}_heads_targets.npy", np.arange(n, dtype=np.int64) % 2)
        np.save(tmp_path / f"rank0_{split}_heads_inds.npy", np.arange(n, dtype=np.int64))
    assert load_features(tmp_path, "test", "heads")["features"].shape == (0, 2)
    assert load_features(tmp_path, "test", "heads", flatten=False)["features"].shape == (0, 2, 1, 1)
    proc = tool(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"],
                script=NN_TOOL, ok=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1] == (
        f"error: kNN heads in {tmp_path}: needs train and test features; got 6 train and 0 test samples"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    with pytest.raises(UserError, match="got 6 train and 0 test samples"):
        knn_accuracy(np.ones((6, 2)), np.zeros(6, int), np.ones((0, 2)), np.zeros(0, int))


def test_knn_of_features_beyond_float32s_comfortable_range_is_right_or_one_line() -> None:
    """Finite features whose squares overflow float32 (~1e19 and up), or float64 features beyond
    float32's range: the cosine kNN normalised them in float32 (an infinite norm made the rows all
    zeros, so every train row tied and top-1 came out at chance) or after the cast (1e300 became inf,
    1e-300 became 0); it is now the same as at scale 1. A raw dot product that overflows float32
    cannot rank neighbours: one line naming L2_NORM_FEATS, not an accuracy of NaN votes."""
    rng = np.random.default_rng(0)
    train = rng.normal(size=(50, 8)).astype(np.float32)
    labels = np.arange(50) % 5
    test = train[:20] + 0.01 * rng.normal(size=(20, 8)).astype(np.float32)
    expected = knn_accuracy(train, labels, test, labels[:20], topk=1)
    assert expected[1] == 100.0
    for scale, dtype in ((1e19, np.float32), (1e30, np.float32), (1e300, np.float64), (1e-300, np.float64)):
        got = knn_accuracy(train.astype(dtype) * scale, labels, test.astype(dtype) * scale, labels[:20], topk=1)
        assert got == expected, (scale, dtype, got)
    with pytest.raises(UserError, match=r"dot products of the test and train features overflow float32 .*"
                                        r"config\.NEAREST_NEIGHBOR\.L2_NORM_FEATS=true$"):
        knn_accuracy(train * 1e19, labels, test * 1e19, labels[:20], topk=1, l2_norm=False)
    with pytest.raises(UserError, match=r"^kNN: train features hold values beyond float32's range"):
        knn_accuracy(train.astype(np.float64) * 1e300, labels, test.astype(np.float64), labels[:20], l2_norm=False)


def test_knn_tool_names_the_layer_and_folder_whose_features_do_not_match(tmp_path: Path) -> None:
    """A VISSL folder with two layers, one whose train and test dims differ: the tool's line names
    that layer and the folder (it said only 'kNN: train features have dim 3 but test features have
    dim 5', not which of the layers it evaluates)."""
    for split, dims in (("train", {"res4": 3, "res5": 4}), ("test", {"res4": 5, "res5": 4})):
        for layer, dim in dims.items():
            np.save(tmp_path / f"rank0_{split}_{layer}_features.npy", np.ones((6, dim), dtype=np.float32))
            np.save(tmp_path / f"rank0_{split}_{layer}_targets.npy", np.arange(6) % 2)
            np.save(tmp_path / f"rank0_{split}_{layer}_inds.npy", np.arange(6))
    proc = tool(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"],
                script=NN_TOOL, ok=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: kNN res4 in {tmp_path}: train features have dim 3 but test features have dim 5"), proc.stderr[-2000:]


def test_knn_tool_names_a_layer_that_only_one_split_has(tmp_path: Path) -> None:
    """A layer with train shards and no test shards (or the reverse) cannot be evaluated: the tool
    warns naming it and the split that lacks it (it was left out without a word)."""
    layers = {"train": ("res4", "res5"), "test": ("res5", "heads")}
    for split, names in layers.items():
        for layer in names:
            np.save(tmp_path / f"rank0_{split}_{layer}_features.npy", np.eye(6, 4, dtype=np.float32))
            np.save(tmp_path / f"rank0_{split}_{layer}_targets.npy", np.arange(6) % 2)
            np.save(tmp_path / f"rank0_{split}_{layer}_inds.npy", np.arange(6))
    proc = tool(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"],
                script=NN_TOOL)
    assert [ln.split(" (")[0] for ln in proc.stdout.splitlines() if ln.startswith("kNN ")] == ["kNN res5"]
    out = proc.stdout + proc.stderr
    assert f"kNN: 'res4' in {tmp_path} has train features but no test features: not evaluated" in out
    assert f"kNN: 'heads' in {tmp_path} has test features but no train features: not evaluated" in out


def test_knn_tool_reading_a_features_path_checks_no_data_or_model_of_the_config(tmp_path: Path, capsys) -> None:
    """With NEAREST_NEIGHBOR.FEATURES.PATH the kNN test reads features only. A VISSL kNN config
    that names its data by DATASET_NAMES (no DATA_PATHS), or a trunk ssl_engine lacks whose
    features VISSL extracted, is tested on those features (was: exit 2, 'config.DATA.TRAIN.DATA_PATHS
    is missing the path for source 0', about data the test never reads)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 4)):
        np.save(tmp_path / f"rank0_chunk0_{split}_res5avg_features.npy", rng.normal(size=(n, 8)).astype(np.float32))
        np.save(tmp_path / f"rank0_chunk0_{split}_res5avg_targets.npy", (np.arange(n) % 2).reshape(n, 1))
        np.save(tmp_path / f"rank0_chunk0_{split}_res5avg_inds.npy", np.arange(n))
    yaml = tmp_path / "eval_resnet_8gpu_in1k_kNN.yaml"
    yaml.write_text(
        "# @package _global_\nconfig:\n  DATA:\n    TRAIN:\n      DATA_SOURCES: [disk_folder]\n"
        "      LABEL_SOURCES: [disk_folder]\n      DATASET_NAMES: [imagenet1k_folder]\n    TEST:\n"
        "      DATA_SOURCES: [disk_folder]\n      LABEL_SOURCES: [disk_folder]\n      DATASET_NAMES: [imagenet1k_folder]\n"
        "  MODEL:\n    TRUNK:\n      NAME: vision_transformer\n  NEAREST_NEIGHBOR:\n    TOPK: 3\n")
    spec = importlib.util.spec_from_file_location("nearest_neighbor_test", NN_TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = mod.main([f"config={yaml}", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "kNN res5avg (k=3, sigma=0.1, dot product; 6 train / 4 test, dim 8): top-1 " in out
    # extracting first, the same config's data and trunk are checked as before
    code = mod.main([f"config={yaml}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}", "config.MACHINE.DEVICE=cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vision_transformer" in err[0], err


def test_knn_tool_reads_targets_of_more_dimensions_and_refuses_targets_without_a_label(tmp_path: Path) -> None:
    """VISSL targets saved as [N, 1, 1]: the first column was an [N, 1] array, and the vote's
    scatter_add a RuntimeError traceback from the kNN tool; they are now read as [N, 1] targets.
    Targets with no label per sample ([N, 0]) are one line naming the split, exit 2 (an IndexError)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 8)).astype(np.float32) * 5
    for split, n in (("train", 30), ("test", 12)):
        labels = np.arange(n) % 3
        np.save(tmp_path / f"rank0_{split}_heads_features.npy", centres[labels] + rng.normal(size=(n, 8)).astype(np.float32))
        np.save(tmp_path / f"rank0_{split}_heads_targets.npy", labels.reshape(n, 1, 1).astype(np.int64))
        np.save(tmp_path / f"rank0_{split}_heads_inds.npy", np.arange(n, dtype=np.int64))
    args = ["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}",
            "config.NEAREST_NEIGHBOR.TOPK=3"]
    proc = tool(args, script=NN_TOOL)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("kNN heads")]
    assert len(line) == 1 and "top-1 100.00%" in line[0], proc.stdout[-2000:] + proc.stderr[-2000:]
    np.save(tmp_path / "rank0_test_heads_targets.npy", np.zeros((12, 0), dtype=np.int64))
    proc = tool(args, script=NN_TOOL, ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: kNN heads in {tmp_path}: the test targets have shape (12, 0): no label per sample; targets are [N] "
        f"class ids, or [N, L] with the class id first"), proc.stderr[-2000:]


def test_knn_tool_checks_the_extraction_before_launch_as_the_engine_tool_does(tmp_path: Path) -> None:
    """The kNN tool launched its extraction without the checks run_distributed_engines.py makes
    before any rank starts: an EXTRACT_FEATURES.OUTPUT_DIR that is a file was a FileExistsError
    traceback (exit 1) from the rank, after CHECKPOINT.DIR had been made for its log. Now the
    engine tool's one line, exit 2, and nothing is made."""
    afile = tmp_path / "features"
    afile.write_text("not a folder\n")
    run = tmp_path / "run"
    proc = tool(["config=extract/simclr_digits_trunk", f"config.CHECKPOINT.DIR={run}",
                 f"config.EXTRACT_FEATURES.OUTPUT_DIR={afile}", *DIGITS_SMALL], script=NN_TOOL, ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: config.EXTRACT_FEATURES.OUTPUT_DIR={afile} is a file, not a folder; name a folder for the run's files"]
    assert not run.exists() and afile.read_text() == "not a folder\n"


def test_knn_of_features_of_dim_1_warns_that_the_cosine_keeps_only_their_sign(caplog) -> None:
    """A dim-1 layer L2-normalised is -1, 0 or +1: the accuracy compares signs only, which the
    user learns from a warning; raw values (L2_NORM_FEATS=false) compare as they are."""
    train, labels = np.array([[0.1], [0.2], [5.0], [6.0]]), np.array([0, 0, 1, 1])
    query = np.array([[5.5]])
    with caplog.at_level(logging.WARNING, logger="ssl_engine.knn"):
        knn_accuracy(train, labels, query, np.array([1]), topk=2, sigma=0.1, topk_list=[1])  # all four tie at +1
    assert any("the features have dim 1" in r.getMessage() and "L2_NORM_FEATS=false" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ssl_engine.knn"):
        assert knn_accuracy(train, labels, query, np.array([1]), topk=2, sigma=0.1, topk_list=[1], l2_norm=False) == {1: 100.0}
    assert not caplog.records


def test_knn_of_features_of_dim_0_is_one_line(tmp_path: Path) -> None:
    """VISSL shards whose features are [N, 0]: the cosine's scale (a max over each empty row) was
    numpy's ValueError traceback from the kNN tool; one line, exit 2."""
    with pytest.raises(UserError, match=r"^kNN: the features have dim 0 \(train shape \(6, 0\)\): no value to compare"):
        knn_accuracy(np.ones((6, 0)), np.arange(6) % 2, np.ones((3, 0)), np.arange(3) % 2)
    for split, n in (("train", 6), ("test", 3)):
        np.save(tmp_path / f"rank0_{split}_heads_features.npy", np.ones((n, 0), dtype=np.float32))
        np.save(tmp_path / f"rank0_{split}_heads_targets.npy", np.arange(n, dtype=np.int64) % 2)
        np.save(tmp_path / f"rank0_{split}_heads_inds.npy", np.arange(n, dtype=np.int64))
    proc = tool(["config=extract/simclr_digits_trunk", f"config.NEAREST_NEIGHBOR.FEATURES.PATH={tmp_path}"],
                script=NN_TOOL, ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: kNN heads in {tmp_path}: the features have dim 0 (train shape (6, 0)): no value to compare; extract "
        f"a layer with values")
