"""Validation of a composed config against defaults.yaml, before any process starts.

Unknown keys (with the closest valid names), wrong types (key, value and expected type) and
out-of-range values are ConfigErrors. Keys marked ``[compat]`` in defaults.yaml are accepted
for VISSL configs but not acted on: a non-default value logs one warning naming the key.
"""

import logging
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import ConfigError, closest

log = logging.getLogger(__name__)

# Subtrees whose children are free-form (a registered part's own options).
_OPEN_PARENTS = {"config.MODEL.TRUNK", "config.LOSS", "config.METERS"}


def flatten_keys(tree: Dict[str, Any], prefix: str = "") -> List[str]:
    """Every key path of a nested dict, e.g. 'config.DATA.TRAIN.BATCHSIZE_PER_REPLICA'."""
    out = []
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        out.append(path)
        if isinstance(v, dict):
            out.extend(flatten_keys(v, path))
    return out


def compat_keys(defaults_file: Optional[Path] = None) -> Set[str]:
    """Key paths marked ``# [compat]`` in defaults.yaml (a mark covers the key's subtree)."""
    from ssl_engine.config.compose import DEFAULTS_FILE

    stack: List[tuple] = []
    marked = set()
    for line in (defaults_file or DEFAULTS_FILE).read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_][\w]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if "[compat]" in line.split("#", 1)[-1] and "#" in line:
            marked.add(".".join(k for _, k in stack))
    return marked


def _type_name(v: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "mapping"}.get(
        type(v), type(v).__name__
    )


def _coerce(path: str, value: Any, default: Any) -> Any:
    """Value converted to the default's type where that is lossless; ConfigError otherwise."""
    if default is None or value is None:
        return value
    bad = ConfigError(
        f"{path}={value!r} has the wrong type: expected {_type_name(default)}, got {_type_name(value)}"
    )
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise bad
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value) if not isinstance(default, str) else value if False else str(value)
        raise bad
    if isinstance(default, list):
        if isinstance(value, (list, tuple)):
            return list(value)
        raise bad
    if isinstance(default, dict):
        if isinstance(value, dict):
            return value
        raise bad
    return value


class _Walker:
    def __init__(self, added: Iterable[str], compat: Set[str]) -> None:
        self.added = {a if a.startswith("config") or a == "engine_name" else a for a in added}
        self.compat = compat
        self.unknown: List[str] = []
        self.compat_set: List[str] = []
        self.all_known: List[str] = []

    def walk(self, user: Dict[str, Any], default: Dict[str, Any], path: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in user.items():
            kpath = f"{path}.{key}" if path else str(key)
            if key not in default:
                if any(kpath == a or kpath.startswith(a + ".") for a in self.added):
                    log.warning("config key %s is not a known option; added as asked with '+'", kpath)
                    out[key] = value
                elif path in _OPEN_PARENTS and isinstance(value, dict):
                    out[key] = value  # options of a user-registered trunk/loss/meter, checked by its owner
                else:
                    self.unknown.append(kpath)
                continue
            dval = default[key]
            if isinstance(dval, dict) and dval and isinstance(value, dict):
                out[key] = self.walk(value, dval, kpath)
                continue
            out[key] = _coerce(kpath, value, dval)
            if kpath in self.compat or any(kpath.startswith(c + ".") for c in self.compat):
                if out[key] != dval:
                    self.compat_set.append(kpath)
        # keys the user dropped (cannot happen through hydra, but a hand-made dict may)
        for key, dval in default.items():
            if key not in out:
                out[key] = dval
        return out


_RANGES = [
    ("LOG_FREQUENCY", lambda v: v > 0, "an integer > 0"),
    ("TEST_EVERY_NUM_EPOCH", lambda v: v > 0, "an integer > 0"),
    ("OPTIMIZER.num_epochs", lambda v: v > 0, "an integer > 0"),
    ("DATA.TRAIN.BATCHSIZE_PER_REPLICA", lambda v: v > 0, "an integer > 0"),
    ("DATA.TEST.BATCHSIZE_PER_REPLICA", lambda v: v > 0, "an integer > 0"),
    ("DATA.NUM_DATALOADER_WORKERS", lambda v: v >= 0, "an integer >= 0"),
    ("MACHINE.DEVICE", lambda v: v in ("cpu", "gpu"), "one of cpu, gpu"),
    ("DISTRIBUTED.NUM_NODES", lambda v: v >= 1, "an integer >= 1"),
    ("DISTRIBUTED.NUM_PROC_PER_NODE", lambda v: v >= 1, "an integer >= 1"),
    ("DISTRIBUTED.INIT_METHOD", lambda v: v in ("tcp", "file", "env"), "one of tcp, file, env"),
    ("DISTRIBUTED.TIMEOUT_MINUTES", lambda v: v > 0, "a number > 0"),
    ("MULTI_PROCESSING_METHOD", lambda v: v in ("fork", "spawn", "forkserver"), "one of fork, spawn, forkserver"),
    ("DATA.TRAIN.LABEL_TYPE", lambda v: v in ("standard", "sample_index", "zero"), "one of standard, sample_index, zero"),
    ("DATA.TEST.LABEL_TYPE", lambda v: v in ("standard", "sample_index", "zero"), "one of standard, sample_index, zero"),
    ("DATA.TRAIN.ON_CORRUPT_IMAGE", lambda v: v in ("skip", "error"), "one of skip, error"),
    ("DATA.TEST.ON_CORRUPT_IMAGE", lambda v: v in ("skip", "error"), "one of skip, error"),
    ("DATA.TRAIN.DATA_LIMIT", lambda v: v == -1 or v > 0, "-1 (all) or an integer > 0"),
    ("DATA.TEST.DATA_LIMIT", lambda v: v == -1 or v > 0, "-1 (all) or an integer > 0"),
    ("TRAINER.GRAD_ACCUMULATION_STEPS", lambda v: v >= 1, "an integer >= 1"),
    ("CHECKPOINT.CHECKPOINT_FREQUENCY", lambda v: v >= 1, "an integer >= 1"),
    ("CHECKPOINT.CHECKPOINT_ITER_FREQUENCY", lambda v: v == -1 or v > 0, "-1 (never) or an integer > 0"),
    ("CHECKPOINT.KEEP_LAST", lambda v: v == -1 or v > 0, "-1 (all) or an integer > 0"),
    ("CHECKPOINT.BACKEND", lambda v: v == "disk", "disk"),
    ("MODEL.AMP_PARAMS.AMP_TYPE", lambda v: v in ("pytorch", "apex"), "one of pytorch, apex"),
    ("MODEL.AMP_PARAMS.AMP_DTYPE", lambda v: v in ("auto", "float16", "bfloat16"), "one of auto, float16, bfloat16"),
    ("MODEL.INPUT_TYPE", lambda v: v in ("rgb", "gray"), "one of rgb, gray"),
    ("EXTRACT_FEATURES.CHUNK_THRESHOLD", lambda v: v >= 0, "an integer >= 0 (0 = default)"),
    ("NEAREST_NEIGHBOR.TOPK", lambda v: v > 0, "an integer > 0"),
    ("NEAREST_NEIGHBOR.SIGMA", lambda v: v > 0, "a number > 0"),
]


def _get(cfg: Dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_ranges(cfg: Dict[str, Any]) -> None:
    """Values that have the right type but make no sense (batch size 0, unknown device...)."""
    for dotted, ok, valid in _RANGES:
        value = _get(cfg, dotted)
        if not ok(value):
            raise ConfigError(f"config.{dotted}={value!r} is out of range: expected {valid}")
    splits = [s for s in ("TRAIN", "TEST") if cfg["DATA"][s]["DATA_SOURCES"]]
    for s in splits:
        d = cfg["DATA"][s]
        paths = d["DATA_PATHS"]
        if paths and len(paths) != len(d["DATA_SOURCES"]):
            raise ConfigError(
                f"config.DATA.{s}.DATA_PATHS has {len(paths)} entries but DATA_SOURCES has "
                f"{len(d['DATA_SOURCES'])}: give one path per source"
            )


def validate(
    root: Dict[str, Any], defaults: Dict[str, Any], added_keys: Iterable[str] = (), warn_unused: bool = True
) -> AttrDict:
    """Check a composed root dict against the defaults; return the config node as an AttrDict."""
    walker = _Walker(added_keys, compat_keys())
    merged = walker.walk(root, defaults, "")
    if walker.unknown:
        known = flatten_keys(defaults)
        parts = []
        for key in walker.unknown:
            leaf = key.rsplit(".", 1)[-1]
            parent = key.rsplit(".", 1)[0]
            siblings = [k for k in known if k.rsplit(".", 1)[0] == parent]
            near = closest(key, siblings, n=3) or closest(leaf, [k.rsplit(".", 1)[-1] for k in known], n=3)
            if near and "." not in near[0]:
                near = [k for k in known if k.rsplit(".", 1)[-1] in near][:3]
            hint = f" (closest: {', '.join(near)})" if near else ""
            parts.append(f"{key}{hint}")
        raise ConfigError("unknown config key " + "; unknown config key ".join(parts))
    cfg = merged["config"]
    cfg["engine_name"] = merged.get("engine_name", "train")
    check_ranges(cfg)
    if warn_unused:
        for key in walker.compat_set:
            log.warning("config key %s is accepted for VISSL configs but not acted on by ssl_engine", key)
    return AttrDict(cfg)


def check_registered_names(cfg: AttrDict) -> None:
    """Every name the config gives a registry must be registered (after USER_MODULES import)."""
    from ssl_engine import registry as R

    R.ENGINES.get(cfg.engine_name)
    R.TASKS.get(cfg.TRAINER.TASK_NAME)
    R.TRAIN_STEPS.get(cfg.TRAINER.TRAIN_STEP_NAME)
    R.TRUNKS.get(cfg.MODEL.TRUNK.NAME)
    for entry in cfg.MODEL.HEAD.PARAMS:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
            raise ConfigError(
                f"config.MODEL.HEAD.PARAMS entry {entry!r} is not of the form [head_name, {{params}}]"
            )
        R.HEADS.get(entry[0])
    R.LOSSES.get(cfg.LOSS.name)
    R.OPTIMIZERS.get(cfg.OPTIMIZER.name)
    meters = list(cfg.METERS.names) + ([cfg.METERS.name] if cfg.METERS.name else [])
    for m in meters:
        R.METERS.get(m)
    for split in ("TRAIN", "TEST"):
        d = cfg.DATA[split]
        for s in d.DATA_SOURCES:
            R.DATA_SOURCES.get(s)
        for s in d.LABEL_SOURCES:
            R.DATA_SOURCES.get(s)
        R.COLLATORS.get(d.COLLATE_FUNCTION)
        for t in d.TRANSFORMS:
            if not isinstance(t, dict) or "name" not in t:
                raise ConfigError(f"config.DATA.{split}.TRANSFORMS entry {t!r} needs a 'name' key")
            R.TRANSFORMS.get(t["name"])
    for h in cfg.HOOKS.CUSTOM:
        if not isinstance(h, dict) or "name" not in h:
            raise ConfigError(f"config.HOOKS.CUSTOM entry {h!r} needs a 'name' key")
        R.HOOKS.get(h["name"])


def check_data_paths(cfg: AttrDict) -> None:
    """Folders and files named in DATA_PATHS exist (checked before processes start)."""
    splits = ["TRAIN", "TEST"]
    for split in splits:
        d = cfg.DATA[split]
        for i, source in enumerate(d.DATA_SOURCES):
            if source not in ("disk_folder", "disk_filelist"):
                continue
            paths = d.DATA_PATHS
            if i >= len(paths) or not paths[i]:
                raise ConfigError(
                    f"config.DATA.{split}.DATA_PATHS is missing the path for source {i} ({source}): "
                    f"give a {'folder' if source == 'disk_folder' else 'file list'}"
                )
            p = paths[i][0] if isinstance(paths[i], list) else paths[i]
            if not Path(str(p)).expanduser().exists():
                raise ConfigError(f"config.DATA.{split}.DATA_PATHS[{i}]: {p} does not exist")
