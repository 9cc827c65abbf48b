"""Validation of a composed config against defaults.yaml, before any process starts.

Unknown keys (with the closest valid names), wrong types (key, value and expected type) and
out-of-range values are ConfigErrors. Keys marked ``[compat]`` in defaults.yaml are accepted
for VISSL configs but not acted on: a non-default value logs one warning naming the key.
"""

import copy
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import ConfigError, UserError, closest, does_not_exist, expand_user

log = logging.getLogger(__name__)

# Subtrees whose children are free-form (a registered part's own options).
_OPEN_PARENTS = {"config.MODEL.TRUNK", "config.LOSS", "config.METERS"}
# Numbers for which +inf means something (the max norm in gradient clipping).
_INFINITY_ALLOWED = {"config.MODEL.GRAD_CLIP.NORM_TYPE"}
# Mappings whose keys and values are passed on as they are (VISSL hands AMP_ARGS to apex).
_FREE_FORM = {"config.MODEL.AMP_PARAMS.AMP_ARGS"}
# Lists of names (modules, meters, parameter-name parts, splits): each entry is a string, a number
# read as its text. A list or mapping there ended the run in a TypeError traceback where the names
# were used (SKIP_LAYERS: [[a]] when the weights load, METERS.names: [5] while composing).
_NAME_LISTS = {
    "config.USER_MODULES", "config.METERS.names", "config.MODEL.WEIGHTS_INIT.SKIP_LAYERS",
    "config.MODEL.NON_TRAINABLE_PARAMS", "config.OPTIMIZER.non_regularized_parameters", "config.EXTRACT_FEATURES.SPLITS",
} | {f"config.METERS.{m}.meter_names" for m in ("accuracy_list_meter", "precision_at_k_list_meter",
                                                "recall_at_k_list_meter", "mean_ap_list_meter")}


def flatten_keys(tree: Dict[str, Any], prefix: str = "") -> List[str]:
    """Every key path of a nested dict, e.g. 'config.DATA.TRAIN.BATCHSIZE_PER_REPLICA'."""
    out = []
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        out.append(path)
        if isinstance(v, dict):
            out.extend(flatten_keys(v, path))
    return out


def _near_miss(name: str, siblings: Iterable[str]) -> bool:
    """Whether an unknown section name under an open parent (``_OPEN_PARENTS``) reads as a typo
    or an older name of a built-in section (``simclr_info_nce_los``, ``RESNET``, VISSL's
    ``accuracy_list``) rather than the options of a part of the user's own: those are reported
    as unknown keys with the closest name, not silently left unused."""
    import difflib

    names = [str(s) for s in siblings]
    if name.lower() in (s.lower() for s in names):
        return True
    return bool(difflib.get_close_matches(name, names, n=1, cutoff=0.8))


def keys_beyond_defaults(tree: Dict[str, Any], defaults: Dict[str, Any], prefix: str = "") -> List[str]:
    """The topmost key paths of ``tree`` that defaults.yaml does not have (keys added with '+'),
    leaving out the free-form options of registered parts (``_OPEN_PARENTS``)."""
    out: List[str] = []
    for k, v in tree.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if k not in defaults:
            if prefix not in _OPEN_PARENTS:
                out.append(path)
        elif isinstance(v, dict) and isinstance(defaults[k], dict) and defaults[k]:
            out.extend(keys_beyond_defaults(v, defaults[k], path))
    return out


def nearest_keys(key: str, known: Iterable[str], n: int = 3) -> List[str]:
    """Valid key paths closest to an unknown one: siblings with a similar name when there are
    any, else keys anywhere whose last part is similar (a key put in the wrong section)."""
    known = list(known)
    parent, _, leaf = key.rpartition(".")
    moved = [k for k in known if k.rpartition(".")[2] == leaf and k != key]
    if moved:  # the same key in another section: most likely put in the wrong place
        return sorted(moved, key=len)[:n]
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    by_leaf = {k.rpartition(".")[2]: k for k in siblings}
    near = [by_leaf[x] for x in closest(leaf, by_leaf, n=n)]
    if near:
        return near
    leaves: Dict[str, List[str]] = {}
    for k in known:
        leaves.setdefault(k.rpartition(".")[2], []).append(k)
    for x in closest(leaf, leaves, n=n, cutoff=0.7):
        near += [k for k in leaves[x] if k not in near]
    return near[:n]


# Sections of VISSL configs read by VISSL's other tools, or by VISSL features ssl_engine lacks:
# accepted whole ([compat] in defaults.yaml) and, when a config sets one, named with what reads it
_OTHER_TOOLS = {
    "config.SVM": "VISSL's SVM benchmark (tools/train_svm.py)",
    "config.LOW_SHOT_BENCHMARK": "VISSL's low-shot benchmark (tools/train_svm_low_shot.py)",
    "config.CLUSTERFIT": "VISSL's feature clustering for ClusterFit (tools/cluster_features_and_label.py)",
    "config.IMG_RETRIEVAL": "VISSL's instance retrieval benchmark (tools/instance_retrieval_test.py)",
    "config.RANKING": "VISSL's feature ranking (tools/extract_feature_and_rank.py)",
    "config.GEO_LOCALIZATION": "VISSL's geo-localization benchmark (tools/geolocalization_test.py)",
    "config.DISTILLATION": "VISSL's knowledge distillation",
    "config.MONITORING": "VISSL's activation and gradient monitoring",
    "config.REPRODUCIBILITY": "VISSL's reproducibility switches",
}


def not_acted_on_message(key: str) -> str:
    """The warning for a [compat] key a config sets: the section of another VISSL tool says which."""
    if key in _OTHER_TOOLS:
        return (f"config key {key} configures {_OTHER_TOOLS[key]}, which ssl_engine does not provide: the "
                f"section is not acted on (features for your own benchmark: --engine=extract_features; "
                f"benchmarks here: tools/nearest_neighbor_test.py and linear evaluation, see README)")
    return f"config key {key} is accepted for VISSL configs but not acted on by ssl_engine"


def unknown_key_message(key: str, known: Iterable[str], added_hint: bool = True) -> str:
    """'unknown config key K (closest: ...)', or the valid keys of its section when none is close."""
    known = list(known)
    near = nearest_keys(key, known)
    if near:
        hint = f" (closest: {', '.join(near)})"
    else:
        parent = key.rpartition(".")[0]
        siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
        shown = ", ".join(siblings[:12]) + (", ..." if len(siblings) > 12 else "")
        hint = f" (keys under {parent or 'the top level'}: {shown})" if siblings else ""
    unacted = _compat_ancestor(key)
    pre_release = _pre_release_section(key)
    if pre_release:
        hint = f" ({pre_release} is {PRE_RELEASE_SECTIONS[pre_release]})"
    elif unacted:
        # e.g. a stray key in the options of a VISSL loss this engine lacks: say that first (the
        # closest keys of other sections lead nowhere, and fixing the key only leads to "unknown loss")
        if unacted.count(".") == 2 and unacted.startswith("config.LOSS."):
            hint = (f" ({unacted} holds the options of VISSL's loss {unacted.split('.')[2]!r}, which ssl_engine "
                    f"does not implement; its keys are accepted but not acted on)")
        else:
            hint = f" ({unacted} is accepted for VISSL configs but not acted on by ssl_engine)"
    if key.startswith("config.config."):
        hint += "; the experiment file probably lacks its first line '# @package _global_'"
    elif added_hint:
        hint += f"; to add a key of your own use +{key}=..."
    return f"unknown config key {key}{hint}"


def _compat_ancestor(key: str) -> Optional[str]:
    """The nearest section above ``key`` marked [compat] in defaults.yaml, or None."""
    marked = compat_keys()
    parts = key.split(".")
    for n in range(len(parts) - 1, 1, -1):
        if ".".join(parts[:n]) in marked:
            return ".".join(parts[:n])
    return None


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


def show_value(v: Any) -> str:
    """A value as the user would write it in yaml (null, true, 'text', 3)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "mapping"}.get(
        type(v), type(v).__name__
    )


def _text_that_reads_as(path: str, value: Any, default: Any) -> str:
    """A note for a string given where an int or a bool belongs that reads as one (``'8'``,
    ``'true'``): quoted in a yaml file, or the text of ``${oc.env:NAME}``, which omegaconf always
    gives as a string. Says how to have the variable read as a yaml value instead."""
    if not isinstance(value, str) or not isinstance(default, (bool, int)):
        return ""
    text = value.strip()
    reads = text.lower() in ("true", "false") if isinstance(default, bool) else re.fullmatch(r"[+-]?\d+", text)
    if not reads:  # as oc.decode reads it: true/false in any case, decimal integers
        return ""
    decoded = "${oc.decode:${oc.env:NAME}}"
    return (f" (text that reads as {_type_name(default)}: quoted in a yaml file, or ${{oc.env:NAME}}, which always "
            f"gives text; {decoded} reads the variable as a yaml value, on the command line quoted for hydra: "
            f"\"{path}='{decoded}'\")")


def _coerce(path: str, value: Any, default: Any, nullable: bool = False) -> Any:
    """Value converted to the default's type where that is lossless; ConfigError otherwise.

    ``null`` is accepted where the default is null, means '' for a string key, [] for a list,
    the defaults for a section, and is accepted for ``[compat]`` keys (``nullable``); anywhere
    else it is a wrong type.
    """
    if default is None:
        return value
    if value is None:
        if isinstance(default, str):
            return ""
        if isinstance(default, list):
            return []  # `KEY:` with nothing after it, or `KEY: null`: an empty list
        if isinstance(default, dict):
            return copy.deepcopy(default)  # a section header with nothing under it: its defaults
        if nullable:
            return value
    bad = ConfigError(
        f"{path}={show_value(value)} has the wrong type: expected {_type_name(default)}, got {_type_name(value)}"
        + _text_that_reads_as(path, value, default)
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
        number: Optional[float] = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # yaml reads 1e-5 (no dot) as a string
            except ValueError:
                raise bad from None
        if number is None:
            raise bad
        if not math.isfinite(number) and not (path in _INFINITY_ALLOWED and number == math.inf):
            raise ConfigError(f"{path}={show_value(value)} is not a finite number")
        return number
    if isinstance(default, str):
        if isinstance(value, str):
            if "\x00" in value:
                raise ConfigError(f"{path}={show_value(value)} holds a NUL character")
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if isinstance(default, list):
        if isinstance(value, (list, tuple)):
            return [_name(f"{path}[{i}]", v) for i, v in enumerate(value)] if path in _NAME_LISTS else list(value)
        raise bad
    if isinstance(default, dict):
        if isinstance(value, dict):
            return value
        raise bad
    return value


def _name(path: str, value: Any) -> str:
    """An entry of a list of names (_NAME_LISTS): a string, or a number as its text; ConfigError otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{path}={show_value(value)} has the wrong type: expected string, got {_type_name(value)}")


def _nested_example(dotted: str, value: Any) -> str:
    """``A.B.C`` with ``value`` as the nested yaml a file writes it as: ``A: {B: {C: value}}``."""
    shown = show_value(value) if not isinstance(value, (dict, list)) else "..."
    parts = [p for p in dotted.split(".") if p]
    text = f"{parts[-1]}: {shown}"
    for part in reversed(parts[:-1]):
        text = f"{part}: {{{text}}}"
    return text


class _Walker:
    """Merges a composed tree over the defaults, collecting unknown and [compat] keys."""

    def __init__(self, added: Iterable[str], compat: Set[str]) -> None:
        self.added = set(added)
        self.compat = compat
        self.unknown: List[str] = []
        self.wrong: List[str] = []  # type errors, reported together with the unknown keys
        self.wrong_keys: List[str] = []  # their keys
        self.compat_set: List[str] = []

    def is_compat(self, kpath: str) -> bool:
        """True for a [compat] key and anything under one (checks the key's ancestors, not every mark)."""
        if not self.compat:
            return False
        end = len(kpath)
        while end > 0:
            if kpath[:end] in self.compat:
                return True
            end = kpath.rfind(".", 0, end)
        return False

    def walk(self, user: Dict[str, Any], default: Dict[str, Any], path: str) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for key, value in user.items():
            kpath = f"{path}.{key}" if path else str(key)
            if key not in default:
                if any(kpath == a or kpath.startswith(a + ".") or a.startswith(kpath + ".") for a in self.added):
                    log.warning("config key %s is not a known option; added as asked (with '+', or on a yaml file's "
                                "'# added keys:' line)", kpath)
                    out[key] = value
                elif isinstance(key, str) and "." in key.strip("."):
                    # yaml reads `MODEL.TRUNK.NAME: resnet` as one key named with dots, never as the
                    # nested option: say so, instead of "unknown key config.MODEL.TRUNK.NAME" (which
                    # exists) with the closest names of other sections
                    self.wrong.append(
                        f"{kpath}: the yaml key {key!r} under {path} holds dots, which yaml reads as part of one "
                        f"key's name, not as nested sections; nest it ({_nested_example(key, value)}) or give it on "
                        f"the command line as {kpath}=...")
                    self.wrong_keys.append(kpath)
                elif path in _OPEN_PARENTS and isinstance(value, dict) and not _near_miss(str(key), default):
                    out[key] = value  # options of a user-registered trunk/loss/meter, checked by its owner
                elif path and self.is_compat(path):
                    # a yaml key inside a section not acted on (e.g. the options of a VISSL loss this
                    # engine lacks) that VISSL's defaults lack too: VISSL's own files hold such keys
                    # and VISSL takes them; kept and warned about like the section's other keys, so
                    # that the error the user sees is the one that matters (the missing loss)
                    out[key] = value
                    self.compat_set.append(kpath)
                else:
                    self.unknown.append(kpath)
                continue
            dval = default[key]
            if kpath in _FREE_FORM and isinstance(value, dict):
                out[key] = {**dval, **value}
                # its own [compat] options (AMP_ARGS.opt_level) are still reported when set
                self.compat_set += [f"{kpath}.{k}" for k, v in value.items()
                                    if k in dval and v != dval[k] and self.is_compat(f"{kpath}.{k}")]
                continue
            if isinstance(dval, dict) and dval and isinstance(value, dict):
                out[key] = self.walk(value, dval, kpath)
                continue
            compat = self.is_compat(kpath)
            try:
                out[key] = _coerce(kpath, value, dval, nullable=compat)
            except ConfigError as e:
                if not compat:
                    self.wrong.append(str(e))
                    self.wrong_keys.append(kpath)
                out[key] = value  # [compat]: not acted on, so any value a VISSL config holds is kept as written
            if compat and out[key] != dval:
                self.compat_set.append(kpath)
        # keys the user dropped (cannot happen through hydra, but a hand-made dict may)
        for key, dval in default.items():
            if key not in out:
                out[key] = dval
        return out


_RANGES = [
    ("LOG_FREQUENCY", lambda v: v > 0, "an integer > 0"),
    ("TEST_EVERY_NUM_EPOCH", lambda v: v > 0, "an integer > 0"),
    # the run builds its list of phases up front (two per epoch): 10**6 epochs take ~200 MB
    ("OPTIMIZER.num_epochs", lambda v: 0 < v <= 1_000_000, "an integer in 1..1000000"),
    ("DATA.TRAIN.BATCHSIZE_PER_REPLICA", lambda v: v > 0, "an integer > 0"),
    ("DATA.TEST.BATCHSIZE_PER_REPLICA", lambda v: v > 0, "an integer > 0"),
    # an absolute bound only: this may run on a login node, not where the ranks run (they check
    # against their machine's CPUs, ssl_engine.data.loader.check_num_workers)
    ("DATA.NUM_DATALOADER_WORKERS", lambda v: 0 <= v <= 1024, "an integer in 0..1024"),
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
    # checked here, not only where a multi-rank run converts its BatchNorms (models.convert_sync_batchnorm)
    ("MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE", lambda v: v.lower() in ("pytorch", "apex"), "one of pytorch, apex"),
    ("MODEL.AMP_PARAMS.AMP_DTYPE", lambda v: v in ("auto", "float16", "bfloat16"), "one of auto, float16, bfloat16"),
    ("MODEL.INPUT_TYPE", lambda v: v in ("rgb", "bgr", "gray", "lab"), "one of rgb, bgr (3 channels), gray, lab (1)"),
    ("EXTRACT_FEATURES.CHUNK_THRESHOLD", lambda v: v >= 0, "an integer >= 0 (0 = default)"),
    ("NEAREST_NEIGHBOR.TOPK", lambda v: v > 0, "an integer > 0"),
    ("NEAREST_NEIGHBOR.SIGMA", lambda v: v > 0, "a number > 0"),
    ("NEAREST_NEIGHBOR.TEST_CHUNK_SIZE", lambda v: v > 0, "an integer > 0"),
    ("NEAREST_NEIGHBOR.TOPK_LIST", lambda v: len(v) > 0 and all(type(k) is int and k > 0 for k in v),
     "a list of one or more integers > 0 (the k of each top-k accuracy, e.g. [1, 5])"),
    ("SEED_VALUE", lambda v: 0 <= v < 2**62, "an integer in [0, 2**62)"),
    ("CHECKPOINT.DIR", lambda v: v.strip() != "", "a folder path (not empty)"),
    # clip_grad_norm_ with a negative norm flips the gradients (ascent), with 0 it zeroes them
    ("MODEL.GRAD_CLIP.MAX_NORM", lambda v: 0 < v < math.inf, "a number > 0"),
    ("MODEL.GRAD_CLIP.NORM_TYPE", lambda v: v > 0, "a number > 0, or inf (the largest absolute gradient)"),
    ("DISTRIBUTED.BACKEND", lambda v: v in ("nccl", "gloo"), "one of nccl, gloo (gloo is used on cpu)"),
    # SummaryWriter's writer thread polls its queue without waiting when flush_secs <= 0: a core
    # spun for the whole run (training 4-6x slower on a small machine), as it does in VISSL
    ("HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN", lambda v: v > 0, "an integer > 0 (minutes)"),
    # 0 or less wrote the histograms at every iteration (VISSL: a ZeroDivisionError for 0)
    ("HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS", lambda v: v > 0, "an integer > 0"),
    # the profiler's window: a negative start or warm-up, or 0 recorded iterations, was silently
    # read as 0 and 1 (a trace of one iteration where none was asked for)
    ("PROFILING.START_ITERATION", lambda v: v >= 0, "an integer >= 0 (a train iteration)"),
    ("PROFILING.WARMUP_ITERATIONS", lambda v: v >= 0, "an integer >= 0"),
    ("PROFILING.NUM_ITERATIONS", lambda v: v >= 1, "an integer >= 1 (the iterations recorded)"),
    # a negative warm-up was read as 0 without a word
    ("HOOKS.ITERATION_TIMER.WARMUP_ITERATIONS", lambda v: v >= 0,
     "an integer >= 0 (the first train iterations left out of the per-iteration time; 0 = none)"),
    # VISSL reads any value <= 0 as 'phase ends only'; -1 (its default) and 0 keep that meaning,
    # anything lower is a typo rather than a setting
    ("HOOKS.PERF_STATS.PERF_STAT_FREQUENCY", lambda v: v >= -1,
     "-1 or 0 (the breakdown at phase ends only, as in VISSL) or N >= 1 (also every N train iterations)"),
    # the memory line's period: -7 read as 'never' without a word, as did 0
    ("HOOKS.MEMORY_SUMMARY.LOG_EVERY_N_ITERS", lambda v: v >= -1,
     "-1 or 0 (no memory line) or N >= 1 (a line every N train iterations)"),
    ("HOOKS.MEMORY_SUMMARY.LOG_ITERATION_NUM", lambda v: v >= 0,
     "an integer >= 0 (the train iteration after which the summary is printed; 0 = after the last phase only)"),
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
            raise ConfigError(f"config.{dotted}={show_value(value)} is out of range: expected {valid}")
    splits = [s for s in ("TRAIN", "TEST") if cfg["DATA"][s]["DATA_SOURCES"]]
    for s in splits:
        d = cfg["DATA"][s]
        paths = d["DATA_PATHS"]
        if paths and len(paths) != len(d["DATA_SOURCES"]):
            raise ConfigError(
                f"config.DATA.{s}.DATA_PATHS has {len(paths)} entries but DATA_SOURCES has "
                f"{len(d['DATA_SOURCES'])}: give one path per source"
            )


# config keys that name local files or folders: read (False) or written (True)
_PATH_KEYS = [
    ("MODEL.WEIGHTS_INIT.PARAMS_FILE", False),
    ("CHECKPOINT.RESUME_FROM", False),
    ("NEAREST_NEIGHBOR.FEATURES.PATH", False),
    ("CHECKPOINT.DIR", True),
    ("EXTRACT_FEATURES.OUTPUT_DIR", True),
    ("HOOKS.TENSORBOARD_SETUP.LOG_DIR", True),
    ("PROFILING.OUTPUT_FOLDER", True),
    ("SLURM.LOG_FOLDER", True),
]


def check_no_urls(cfg: Dict[str, Any]) -> None:
    """A URL where a local path belongs is one clear error naming the key and the URL as given
    (a path would otherwise collapse its '//' and be reported missing, or be created as a folder)."""
    from ssl_engine.errors import is_url, url_error

    for dotted, output in _PATH_KEYS:
        try:
            value = _get(cfg, dotted)
        except (KeyError, TypeError):
            continue
        if is_url(value):
            raise url_error(f"config.{dotted}", value, output=output)
    for split in ("TRAIN", "TEST"):
        d = cfg["DATA"][split]
        for key in ("DATA_PATHS", "LABEL_PATHS"):
            for i, entry in enumerate(d.get(key) or []):
                for value in entry if isinstance(entry, list) else [entry]:
                    if is_url(value):
                        raise url_error(f"config.DATA.{split}.{key}[{i}]", value)


def unextracted_splits(cfg: Dict[str, Any]) -> List[str]:
    """The DATA splits an extract_features run leaves out (EXTRACT_FEATURES.SPLITS); [] otherwise."""
    if cfg.get("engine_name") != "extract_features":
        return []
    asked = {str(s).upper() for s in cfg["EXTRACT_FEATURES"]["SPLITS"]}
    return [s for s in ("TRAIN", "TEST") if asked and s not in asked]


def without_unextracted_splits(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """For an extract_features run, ``cfg`` with the DATA splits that EXTRACT_FEATURES.SPLITS
    leaves out reset to their defaults (no DATA_SOURCES); ``cfg`` itself otherwise.

    An extraction reads only the splits it is asked for, so the checks of the others (their
    paths, names, ranges, datasets) must not fire: ``EXTRACT_FEATURES.SPLITS=[TRAIN]`` runs a
    config whose TEST data is elsewhere. An empty SPLITS asks for every split with data. Works
    on plain dicts and AttrDicts alike; ``cfg`` is never modified.
    """
    left_out = unextracted_splits(cfg)
    if not left_out:
        return cfg
    from ssl_engine.config.compose import load_defaults

    data_defaults = load_defaults()["config"]["DATA"]
    out = copy.deepcopy(cfg)
    for s in left_out:
        out["DATA"][s] = type(out["DATA"])(data_defaults[s])  # an AttrDict stays one all the way down
    return out


def _deep_merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


# Keys that VISSL's older layout kept elsewhere (its hook generator read cfg.MONITOR_PERF_STATS,
# cfg.TENSORBOARD_SETUP, cfg.MODEL.MODEL_COMPLEXITY, ...): old path -> 0.1.6 path, below config.
MOVED_KEYS = {
    ("MONITOR_PERF_STATS",): ("HOOKS", "PERF_STATS", "MONITOR_PERF_STATS"),
    ("PERF_STAT_FREQUENCY",): ("HOOKS", "PERF_STATS", "PERF_STAT_FREQUENCY"),
    ("ROLLING_BTIME_FREQ",): ("HOOKS", "PERF_STATS", "ROLLING_BTIME_FREQ"),
    ("TENSORBOARD_SETUP",): ("HOOKS", "TENSORBOARD_SETUP"),
    ("MODEL", "MODEL_COMPLEXITY"): ("HOOKS", "MODEL_COMPLEXITY"),
    ("MACHINE", "NUM_DATALOADER_WORKERS"): ("DATA", "NUM_DATALOADER_WORKERS"),
}

# Sections of VISSL's pre-release layout that cannot be moved as MOVED_KEYS are (another name and
# upper-case option keys): what the unknown-key error says instead of the closest keys. Dropping
# one with ~ would change what the run does (a config without its loss trains the default loss),
# so the error does not offer that.
PRE_RELEASE_SECTIONS = {
    "config.CRITERION": (
        "the loss section of VISSL's pre-release layout; VISSL 0.1.6 reads the loss from config.LOSS, with "
        "lower-case option keys (LOSS.name: simclr_info_nce_loss, LOSS.simclr_info_nce_loss.temperature, "
        "...): move it there, as without it the run trains the default loss, CrossEntropyLoss"
    ),
    # the feature evaluation of the pre-release layout: dropped, a linear evaluation would train the
    # whole model from its random init on the trunk's last layer
    "config.MODEL.FEATURE_EVAL_MODE": (
        "the feature-evaluation switch of VISSL's pre-release layout; VISSL 0.1.6 reads "
        "config.MODEL.FEATURE_EVAL_SETTINGS (EVAL_MODE_ON: true, FREEZE_TRUNK_ONLY: true, ...): set it there, as "
        "without it the trunk is trained, not frozen"
    ),
    "config.MODEL.EVAL_FEATURES": (
        "the list of evaluated trunk layers of VISSL's pre-release layout; VISSL 0.1.6 names each with its pool op in "
        "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP ([[res5avg, [Identity, []]]]): set them "
        "there, as without them the heads read the trunk's last layer"
    ),
    "config.MODEL.TRUNK.LINEAR_FEAT_POOL_OPS": (
        "the list of pool ops of VISSL's pre-release layout, one per MODEL.EVAL_FEATURES layer; VISSL 0.1.6 pairs each "
        "layer with its op in config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP: set them there"
    ),
    "config.MODEL.PARAMS_FILE": (
        "the weights file of VISSL's pre-release layout (PATH, STATE_DICT_KEY_NAME); VISSL 0.1.6 reads "
        "config.MODEL.WEIGHTS_INIT.PARAMS_FILE and STATE_DICT_KEY_NAME: set them there, as without them the model "
        "starts from its random init"
    ),
}


def _at_or_under(key: str, place: str) -> bool:
    """Whether config key ``key`` is ``place`` or a key inside it."""
    return key == place or key.startswith(place + ".")


def _pre_release_section(key: str) -> Optional[str]:
    return next((place for place in PRE_RELEASE_SECTIONS if _at_or_under(key, place)), None)


# The older layout's trunk options: MODEL.TRUNK.TRUNK_PARAMS.<X>, read as MODEL.TRUNK.<X>.
TRUNK_PARAMS_PATH = ("MODEL", "TRUNK", "TRUNK_PARAMS")


def is_older_layout_key(key: str) -> bool:
    """Whether ``key`` (``config.MONITOR_PERF_STATS``, ``config.MODEL.TRUNK.TRUNK_PARAMS.RESNETS``,
    ...) lies at or under a place of VISSL's older layout that :func:`_upgrade_older_layout`
    reads at its 0.1.6 place; a command-line override of one is composed where it is written
    and moved from there, as the same key in a yaml file is."""
    return _new_place(key) is not None


def _new_place(key: str) -> Optional[str]:
    """Where :func:`_upgrade_older_layout` reads ``key`` of the older layout
    (``config.MODEL.TRUNK.TRUNK_PARAMS.RESNETS.DEPTH`` -> ``config.MODEL.TRUNK.RESNETS.DEPTH``);
    None for a key of the 0.1.6 layout."""
    for old, new in [*MOVED_KEYS.items(), (TRUNK_PARAMS_PATH, TRUNK_PARAMS_PATH[:-1])]:
        place = "config." + ".".join(old)
        if _at_or_under(key, place):
            return "config." + ".".join(new) + key[len(place):]
    return None


def _is_upgrade_target(key: str) -> bool:
    """Whether ``key`` lies where :func:`_upgrade_older_layout` may move a value to."""
    places = ["config." + ".".join(new) for new in MOVED_KEYS.values()] + ["config." + ".".join(TRUNK_PARAMS_PATH[:-1])]
    return _new_place(key) is None and any(_at_or_under(key, place) for place in places)


def _leaf_keys(node: Any, prefix: str) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaf_keys(v, f"{prefix}.{k}")
    else:
        yield prefix


def keys_set_at_new_places(trees: Iterable[Any], later_keys: Iterable[str] = ()) -> List[str]:
    """The keys that the yaml files (``trees``, in hydra's merge order: an experiment's
    ``defaults:`` entries, its body, ``+config/<group>=<name>`` files) set at a place the older
    layout moves values to (``config.MODEL.TRUNK.RESNETS.DEPTH``) after any file that set the
    same option in the older layout (``TRUNK_PARAMS.RESNETS.DEPTH``): they win over it, as a later
    file wins in VISSL. A later file, or a command-line key (``later_keys``), that sets the same
    option in the older layout wins over them."""
    kept: Dict[str, None] = {}

    def older(key: str) -> bool:
        moved = _new_place(key)
        if moved is not None:
            for k in [k for k in kept if k == moved or k.startswith(moved + ".") or moved.startswith(k + ".")]:
                del kept[k]
        return moved is not None

    for tree in trees:
        for leaf in _leaf_keys(tree.get("config"), "config") if isinstance(tree, dict) else ():
            if not older(leaf) and _is_upgrade_target(leaf):
                kept[leaf] = None
    for key in later_keys:
        older(key.lstrip("+~"))
    return list(kept)


def _node(root: Dict[str, Any], path: Iterable[str]) -> Any:
    node: Any = root
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _values_at(root: Dict[str, Any], keys: Iterable[str]) -> Dict[Tuple[str, ...], Any]:
    """{path: value} of the dotted ``keys`` present in ``root`` (copies, so later moves into
    the same place do not change them)."""
    found: Dict[Tuple[str, ...], Any] = {}
    for key in keys:
        path = tuple(str(key).lstrip("+~").split("."))
        parent = _node(root, path[:-1])
        if path[-1:] and isinstance(parent, dict) and path[-1] in parent:
            found[path] = copy.deepcopy(parent[path[-1]])
    return found


def _put_over(node: Dict[str, Any], key: str, value: Any) -> None:
    """``node[key] = value``, merged into what is there when both are mappings."""
    here = node.get(key)
    node[key] = _deep_merge(here, value) if isinstance(here, dict) and isinstance(value, dict) else value


def _upgrade_older_layout(root: Dict[str, Any]) -> None:
    """Read VISSL's older layout as 0.1.6 does, with one warning per moved key.

    ``MODEL.TRUNK.TRUNK_PARAMS.<X>`` (``TRUNK_PARAMS.RESNETS.DEPTH``) is read as
    ``MODEL.TRUNK.<X>``: 0.1.6 reads the trunk's options one level up and would ignore the old
    place without a word. The keys of MOVED_KEYS (top-level ``MONITOR_PERF_STATS``,
    ``TENSORBOARD_SETUP``, ...) are read at their place under ``HOOKS``. A value at the old
    place goes over the one at the new place, so the config means what it says.
    """
    cfg = root.get("config")
    if not isinstance(cfg, dict):
        return
    trunk = _node(cfg, TRUNK_PARAMS_PATH[:-1])
    if isinstance(trunk, dict) and TRUNK_PARAMS_PATH[-1] in trunk:
        old = trunk.pop(TRUNK_PARAMS_PATH[-1])
        if old is not None:
            if not isinstance(old, dict):
                raise ConfigError(f"config.MODEL.TRUNK.TRUNK_PARAMS={show_value(old)} has the wrong type: expected mapping")
            for name, options in old.items():
                _put_over(trunk, name, options)
            log.warning("config.MODEL.TRUNK.TRUNK_PARAMS is VISSL's older layout; read as config.MODEL.TRUNK.%s",
                        ", config.MODEL.TRUNK.".join(str(k) for k in old))
    for old_path, new_path in MOVED_KEYS.items():
        parent = _node(cfg, old_path[:-1])
        if not isinstance(parent, dict) or old_path[-1] not in parent:
            continue
        value = parent.pop(old_path[-1])
        target = cfg
        for key in new_path[:-1]:
            if not isinstance(target.get(key), dict):
                target[key] = {}
            target = target[key]
        _put_over(target, new_path[-1], value)
        log.warning("config.%s is VISSL's older layout; read as config.%s", ".".join(old_path), ".".join(new_path))


def _refuse_null_sections(given: Dict[Tuple[str, ...], Any], defaults: Dict[str, Any]) -> None:
    """``config.OPTIMIZER=null`` on the command line: a yaml file's empty section header means its
    defaults (as VISSL reads it), but an override that nulls a whole section would silently drop
    the experiment file's settings of it and every override of its keys given before it."""
    for path, value in given.items():
        if value is None and isinstance(_node(defaults, path), dict):
            key = ".".join(path)
            example = next((k for k in _node(defaults, path) if not isinstance(_node(defaults, path)[k], dict)), None)
            how = f"{key}.{example}=..." if example else f"{key}.<KEY>=..."
            raise ConfigError(
                f"{key}=null: a config section cannot be null; change its keys one by one ({how}), or drop the "
                f"experiment file's settings of the whole section with ~{key} (it then takes its defaults)"
            )


def validate(
    root: Dict[str, Any],
    defaults: Dict[str, Any],
    added_keys: Iterable[str] = (),
    warn_unused: bool = True,
    command_line: Iterable[str] = (),
    where: Optional[Callable[[str], Optional[str]]] = None,
) -> AttrDict:
    """Check a composed root dict against the defaults; return the config node as an AttrDict.

    ``command_line`` lists the keys given as overrides (``config.HOOKS.PERF_STATS.X``), and
    those a yaml file sets at their 0.1.6 place after a file with the older layout
    (:func:`keys_set_at_new_places`): their values win over what the older layout moves onto
    the same place. ``where(key)``, when given, names the yaml file that set ``key``: an unknown
    key or a value of the wrong type is reported with it.
    """
    given = _values_at(root, command_line)
    _refuse_null_sections(given, defaults)
    _upgrade_older_layout(root)
    for path, value in given.items():
        node = root
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    walker = _Walker(added_keys, compat_keys())
    merged = walker.walk(root, defaults, "")
    if walker.unknown or walker.wrong:  # every problem of the file at once, not one per attempt
        known = flatten_keys(defaults)

        def in_file(key: str) -> str:
            found = where(key) if where is not None else None
            return f", set in {found}" if found else ""

        problems = ([unknown_key_message(k, known, added_hint=False) + in_file(k) for k in walker.unknown]
                    + [w + in_file(k) for w, k in zip(walker.wrong, walker.wrong_keys)])
        droppable = [k for k in walker.unknown if not _pre_release_section(k)]
        if droppable and not any(k.startswith("config.config.") for k in walker.unknown):
            many = len(droppable) > 1
            problems[walker.unknown.index(droppable[-1])] += (
                f" ({'keys' if many else 'a key'} of a yaml file: fix {'them' if many else 'it'} there, declare "
                f"{'them' if many else 'it'} on the file's '# added keys:' line, or drop {'them' if many else 'it'} "
                f"with {' '.join('~' + k for k in droppable)} on the command line)"
            )
        lacking = _vissl_parts_lacking(merged)
        if lacking:  # the first thing to know: this config's method does not run here whatever its keys
            raise ConfigError(
                f"this config names {len(lacking)} of VISSL's parts that ssl_engine does not implement: "
                f"{', '.join(lacking)}; it runs only once modules in config.USER_MODULES register them. Its keys "
                f"as well: " + "; ".join(problems))
        raise ConfigError("; ".join(problems))
    cfg = merged["config"]
    cfg["engine_name"] = merged.get("engine_name", "train")
    check_no_urls(without_unextracted_splits(cfg))
    check_ranges(without_unextracted_splits(cfg))
    expand_home(cfg)
    if warn_unused:  # before infer_settings, which sets the list meters' sizes from the model
        warn_unnamed_meter_options(cfg, defaults["config"]["METERS"])
    from ssl_engine.config.infer import infer_settings

    infer_settings(cfg, defaults["config"])
    if warn_unused:
        amp_on = bool(((cfg.get("MODEL") or {}).get("AMP_PARAMS") or {}).get("USE_AMP"))
        for key in walker.compat_set:
            if not amp_on and key.startswith("config.MODEL.AMP_PARAMS."):
                continue  # apex's options of a run without AMP: VISSL would not read them either
            log.warning("%s", not_acted_on_message(key))
        warn_unread_dataset_names(cfg, defaults["config"]["DATA"])
        perf = cfg["HOOKS"]["PERF_STATS"]
        if perf["PERF_STAT_FREQUENCY"] > 0 and not perf["MONITOR_PERF_STATS"]:
            log.warning("config.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY=%d is not acted on: the breakdown is logged only "
                        "with config.HOOKS.PERF_STATS.MONITOR_PERF_STATS=true", perf["PERF_STAT_FREQUENCY"])
        warn_unread_tensorboard_folder(cfg, defaults["config"]["HOOKS"]["TENSORBOARD_SETUP"])
    return AttrDict(cfg)


def warn_unnamed_meter_options(cfg: Dict[str, Any], default_meters: Dict[str, Any]) -> None:
    """Options of a meter (``METERS.accuracy_list_meter.topk_values``) set away from their defaults
    while ``METERS.name`` / ``METERS.names`` name no such meter: as in VISSL, only a named meter
    runs, so the run reports no accuracy at all (VISSL's MoCo linear-evaluation config sets
    ``accuracy_list_meter`` without a name); say so, with the key that turns it on."""
    meters = cfg.get("METERS") or {}
    named = set(meters.get("names") or []) | ({meters["name"]} if meters.get("name") else set())
    for meter, options in meters.items():
        default = default_meters.get(meter)
        if meter in named or not isinstance(options, dict) or not isinstance(default, dict):
            continue
        changed = {k: v for k, v in options.items() if k in default and v != default[k]}
        if not changed or meter.endswith("mean_ap_list_meter"):  # [compat] meters: warned about as such
            continue
        shown = ", ".join(f"{k}={show_value(v)}" for k, v in changed.items())
        if named:
            why, fix = f"the named meters ({', '.join(sorted(named))}) do not include it", \
                f"config.METERS.names=[{','.join(sorted(named | {meter}))}]"
        else:
            why, fix = "no meter is named (config.METERS.name is '' and names is [])", f"config.METERS.name={meter}"
        log.warning("config.METERS.%s is set (%s) but %s: it does not run and its values are not reported (as in "
                    "VISSL, only a named meter runs); set %s to run it", meter, shown, why, fix)


def warn_unread_tensorboard_folder(cfg: Dict[str, Any], default_tb: Dict[str, Any]) -> None:
    """EXPERIMENT_LOG_DIR names a sub-folder of LOG_DIR; with LOG_DIR '.' (the default, and the
    only place VISSL 0.1.6 writes events) the events go to CHECKPOINT.DIR/tb_logs and it is not read."""
    tb = ((cfg.get("HOOKS") or {}).get("TENSORBOARD_SETUP")) or {}
    value = tb.get("EXPERIMENT_LOG_DIR")
    if tb.get("USE_TENSORBOARD") and str(tb.get("LOG_DIR")) in ("", ".") and value != default_tb["EXPERIMENT_LOG_DIR"]:
        log.warning(
            "config.HOOKS.TENSORBOARD_SETUP.EXPERIMENT_LOG_DIR=%s is read only with LOG_DIR set to a folder "
            "(events then go to LOG_DIR/EXPERIMENT_LOG_DIR/tb_logs); with LOG_DIR '.' they go to CHECKPOINT.DIR/tb_logs, "
            "as in VISSL: not acted on", value,
        )


def expand_home(cfg: Dict[str, Any]) -> None:
    """Expand a leading ``~`` in the keys that name files and folders (_PATH_KEYS, DATA_PATHS,
    LABEL_PATHS, NEW_IMG_PATH_PREFIX), once, when the config is composed: every part of the run, and every rank on
    any node, then reads the same folder, and none makes a folder named ``~`` where it runs."""
    def expanded(value: Any, key: str, read: bool) -> Any:
        if isinstance(value, str) and value.startswith("~"):
            # an unknown user's ~name is an error where the run reads the path; a split that an
            # extraction leaves out is not checked (see without_unextracted_splits)
            if read:
                expand_user(value, key)  # the check; the text keeps its form (a prefix's trailing '/')
            return os.path.expanduser(value)
        if isinstance(value, list):
            return [expanded(v, f"{key}[{i}]", read) for i, v in enumerate(value)]
        return value

    unread = unextracted_splits(cfg)
    places = [tuple(dotted.split(".")) for dotted, _ in _PATH_KEYS]
    places += [("DATA", split, key) for split in ("TRAIN", "TEST")
               for key in ("DATA_PATHS", "LABEL_PATHS", "NEW_IMG_PATH_PREFIX")]
    for keys in places:
        node = cfg
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and keys[-1] in node:
            read = not (keys[0] == "DATA" and keys[1] in unread)
            node[keys[-1]] = expanded(node[keys[-1]], "config." + ".".join(keys), read)


def warn_unread_dataset_names(cfg: Dict[str, Any], default_data: Dict[str, Any]) -> None:
    """``DATASET_NAMES`` set in a split no torchvision_dataset source reads: VISSL looked such
    names up in its dataset catalog, which ssl_engine does not have, so say it is not acted on."""
    for split in ("TRAIN", "TEST"):
        scfg = (cfg.get("DATA") or {}).get(split) or {}
        names = scfg.get("DATASET_NAMES")
        if names == default_data[split]["DATASET_NAMES"]:
            continue
        sources = list(scfg.get("DATA_SOURCES") or []) + list(scfg.get("LABEL_SOURCES") or [])
        if "torchvision_dataset" not in sources:
            log.warning(
                "config.DATA.%s.DATASET_NAMES is read only by the torchvision_dataset source, which this split does "
                "not use: not acted on (VISSL's dataset catalog is not supported; DATA_PATHS names the data)", split,
            )


def _lookup_one(registry: Any, key: str, name: Any) -> None:
    """``registry.get(name)``, with a ConfigError when the name is not text at all."""
    if not isinstance(name, str):
        raise ConfigError(f"{key}={show_value(name)} must be a name ({registry.kind}), got {_type_name(name)}")
    registry.get(name, key)


def _unnamed_entry(where: str, entry: Any) -> str:
    """The line for an entry of a list of named parts (TRANSFORMS, HOOKS.CUSTOM) without a name:
    a bare name (``TRANSFORMS=[ToTensor]``) is shown as the mapping it should be."""
    if isinstance(entry, str):
        return (f"{where}={show_value(entry)} is a name alone; an entry is a mapping with a 'name' key: "
                f"{{name: {entry}}}")
    return f"{where}={show_value(entry)} needs a 'name' key"


def check_registered_names(cfg: AttrDict) -> None:
    """Every name the config gives a registry must be registered (after USER_MODULES import).

    All unknown names are reported together (one line): a VISSL config for a method this engine
    lacks names several parts (head, collator, transforms), and one per run would send the user
    round the loop once for each.
    """
    from ssl_engine.registry import load_builtin_parts

    load_builtin_parts()  # a caller in Python (not the tool) may not have imported them yet
    unknown: List[Tuple[Any, str, str]] = []  # (registry, config key, name)

    def _lookup(registry: Any, key: str, name: Any) -> None:
        if not isinstance(name, str):
            _lookup_one(registry, key, name)  # not a name at all: that error comes first, alone
        elif name not in registry:
            unknown.append((registry, key, name))

    _check_registered_names(cfg, _lookup)
    # one part named in several places (a data source of TRAIN and TEST) counts once, with its keys
    keys_of: Dict[Tuple[str, str], List[str]] = {}
    registries = {}
    for registry, key, name in unknown:
        keys_of.setdefault((registry.kind, name), []).append(key)
        registries[registry.kind] = registry
    if len(keys_of) == 1:
        registry, _, name = unknown[0]
        registry.get(name, ", ".join(keys_of[(registry.kind, name)]))  # its own message, with the closest names
    if keys_of:
        parts = ", ".join(f"{kind} {n!r} ({', '.join(keys)}{_vissl_note(registries[kind], n)})"
                          for (kind, n), keys in keys_of.items())
        known = "; ".join(f"known {kind}{'es' if kind.endswith('s') else 's'}: {', '.join(r.names()) or '(none)'}"
                          for kind, r in registries.items())
        raise ConfigError(
            f"this config names {len(keys_of)} parts that are not registered: {parts}; {known} "
            f"(your own parts are registered by the modules in config.USER_MODULES)"
        )
    step = ((cfg.get("TRAINER") or {}).get("TRAIN_STEP_NAME"))
    if isinstance(step, str) and step:
        from ssl_engine.train_steps import train_step_of

        train_step_of(step)  # one that is not step(task)


def _vissl_parts_lacking(merged: Dict[str, Any]) -> List[str]:
    """``kind 'name' (key)`` for each part the composed (not yet valid) config names that is one of
    VISSL's the engine lacks, or VISSL's FSDP variant of one (the built-in parts are not loaded
    yet: the registries' static VISSL names decide); none when the config has user modules (not
    imported yet: they may register those names) or its sections are malformed."""
    found: List[str] = []

    def _lookup(registry: Any, key: str, name: Any) -> None:  # the registries' VISSL names need no torch
        if not isinstance(name, str) or name in registry:
            return
        base = registry.fsdp_variants.get(name)  # FSDP variants of implemented parts are a rename, told later
        if name in registry.vissl_names or base in registry.vissl_names:
            found.append(f"{registry.kind} {name!r} ({key}" + (f"; VISSL's FSDP variant of {base!r}" if base else "") + ")")

    try:
        cfg = AttrDict(dict(merged["config"], engine_name=merged.get("engine_name", "train")))
        if cfg.get("USER_MODULES"):
            return []
        _check_registered_names(cfg, _lookup)
    except (ConfigError, AttributeError, KeyError, TypeError, IndexError):
        return []
    return list(dict.fromkeys(found))


def _vissl_note(registry: Any, name: str) -> str:
    """What a multi-part message adds after a name that is VISSL's: an FSDP variant's plain part,
    or that the engine does not implement it."""
    base = registry.fsdp_variants.get(name)
    if base is not None:
        return f"; VISSL's FSDP variant of {base!r}" + ("" if base in registry else ", which ssl_engine does not implement")
    return "; one of VISSL's that ssl_engine does not implement" if name in registry.vissl_names else ""


def _check_registered_names(cfg: AttrDict, _lookup: Callable[[Any, str, Any], None]) -> None:
    from ssl_engine import registry as R

    _lookup(R.ENGINES, "engine_name", cfg.engine_name)
    _lookup(R.TASKS, "config.TRAINER.TASK_NAME", cfg.TRAINER.TASK_NAME)
    _lookup(R.TRAIN_STEPS, "config.TRAINER.TRAIN_STEP_NAME", cfg.TRAINER.TRAIN_STEP_NAME)
    _lookup(R.TRUNKS, "config.MODEL.TRUNK.NAME", cfg.MODEL.TRUNK.NAME)
    for i, entry in enumerate(cfg.MODEL.HEAD.PARAMS):
        # an entry is one head [name, {params}], or a list of them run one after the other
        stages = entry if isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], (list, tuple)) else [entry]
        for j, stage in enumerate(stages):
            where = f"config.MODEL.HEAD.PARAMS[{i}]" + (f"[{j}]" if stages is entry else "")
            if not isinstance(stage, (list, tuple)) or len(stage) != 2 or not isinstance(stage[1], dict):
                raise ConfigError(
                    f"{where}={show_value(stage)} is not of the form [head_name, {{params}}] (or a list of "
                    f"those, run one after the other)"
                )
            _lookup(R.HEADS, f"{where}[0]", stage[0])
    _lookup(R.LOSSES, "config.LOSS.name", cfg.LOSS.name)
    _lookup(R.OPTIMIZERS, "config.OPTIMIZER.name", cfg.OPTIMIZER.name)
    for i, m in enumerate(cfg.METERS.names):
        _lookup(R.METERS, f"config.METERS.names[{i}]", m)
    if cfg.METERS.name:
        _lookup(R.METERS, "config.METERS.name", cfg.METERS.name)
    for split in ("TRAIN", "TEST"):
        d = cfg.DATA[split]
        for key in ("DATA_SOURCES", "LABEL_SOURCES"):
            for i, s in enumerate(d[key]):
                _lookup(R.DATA_SOURCES, f"config.DATA.{split}.{key}[{i}]", s)
        _lookup(R.COLLATORS, f"config.DATA.{split}.COLLATE_FUNCTION", d.COLLATE_FUNCTION)
        for i, t in enumerate(d.TRANSFORMS):
            if not isinstance(t, dict) or "name" not in t:
                raise ConfigError(_unnamed_entry(f"config.DATA.{split}.TRANSFORMS[{i}]", t))
            _lookup(R.TRANSFORMS, f"config.DATA.{split}.TRANSFORMS[{i}].name", t["name"])
    for i, h in enumerate(cfg.HOOKS.CUSTOM):
        if not isinstance(h, dict) or "name" not in h:
            raise ConfigError(_unnamed_entry(f"config.HOOKS.CUSTOM[{i}]", h))
        _lookup(R.HOOKS, f"config.HOOKS.CUSTOM[{i}].name", h["name"])
        if not isinstance(h.get("params") or {}, dict):
            raise ConfigError(f"config.HOOKS.CUSTOM[{i}].params={show_value(h['params'])} must be a mapping")


def check_no_head_mapping(cfg: AttrDict) -> None:
    """VISSL's MULTI_INPUT_HEAD_MAPPING sends each named input through the trunk and gives its
    own head the trunk layers it names ([[data, [res4]]] trains the head on res4). The model
    here has no such routing: its heads read the trunk's last layer (or the feature-eval
    layers), so a run that took the key as accepted-but-unread would train another model than
    the config describes. Refused (after the registry names, so a config for a method the
    engine lacks first hears which parts it needs)."""
    mapping = (cfg.get("MODEL") or {}).get("MULTI_INPUT_HEAD_MAPPING")
    if mapping:
        raise ConfigError(
            f"config.MODEL.MULTI_INPUT_HEAD_MAPPING={show_value(mapping)}: VISSL's routing of each input to its own "
            f"head, from the trunk layers it names, is not implemented (the heads would read the trunk's last layer "
            f"instead); leave it empty (~config.MODEL.MULTI_INPUT_HEAD_MAPPING, which trains every head on the "
            f"trunk's last layer), or give heads other trunk layers with "
            f"config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP (a frozen trunk)"
        )


def check_data_paths(cfg: AttrDict) -> None:
    """Folders and files named in DATA_PATHS exist (checked before processes start). Every
    missing path of every split is named in the one error, not one per run."""
    problems: List[str] = []
    for split in ("TRAIN", "TEST"):
        d = cfg.DATA[split]
        for i, source in enumerate(d.DATA_SOURCES):
            if source not in ("disk_folder", "disk_filelist"):
                continue
            paths = d.DATA_PATHS
            if i >= len(paths) or not paths[i]:
                problems.append(
                    f"config.DATA.{split}.DATA_PATHS is missing the path for source {i} ({source}): "
                    f"give a {'folder' if source == 'disk_folder' else 'file list'}"
                )
                continue
            p = paths[i][0] if isinstance(paths[i], list) else paths[i]
            try:
                found = Path(str(p)).expanduser().exists()
            except (ValueError, OSError) as e:
                problems.append(f"config.DATA.{split}.DATA_PATHS[{i}]={show_value(p)} is not a usable path ({e})")
                continue
            if not found:
                problems.append(does_not_exist(f"config.DATA.{split}.DATA_PATHS[{i}]", p))
    if problems:
        raise ConfigError("; and ".join(problems))


# ----------------------------------------------------------------------------------------
# Checks before launching: what every rank would find out only after it started.


def check_output_folder(path: Any, key: str, value: Optional[Any] = None) -> None:
    """``path`` is a folder, or can be created: no part of it is a file, its nearest existing
    ancestor is writable. ``value``: the setting of ``key`` the message names, where ``path`` is
    a folder made below it (TensorBoard's ``LOG_DIR/EXPERIMENT_LOG_DIR/tb_logs``)."""
    import os

    folder = Path(str(path)).expanduser()
    named = f"{key}={path}" if value is None else f"{key}={value} (its folder {folder})"
    try:
        folder.resolve()
    except (RuntimeError, OSError):  # python raises RuntimeError on a loop of links, newer ones OSError
        raise ConfigError(f"{named} cannot be reached: a loop of symbolic links; name another folder") from None
    for part in (folder, *folder.parents):
        if part.is_symlink() and not part.exists():
            raise ConfigError(f"{named}: {part} is a symbolic link to {os.readlink(part)}, which does not exist; "
                              f"create that folder, or name another")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{named} is a file, not a folder; name a folder for the run's files")
    probe = folder.absolute()  # a relative folder's parent is named by its path, not as '.'
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{named} cannot be created: {probe} is a file")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == folder.absolute() else f"cannot be created: {probe} is not writable"
        raise ConfigError(f"{named} {what} by this user")
    if probe.exists() and probe != folder.absolute():
        # the access bits are not the whole story (/proc, an automount that does not mount, a
        # read-only mount): make and remove one folder where the run will make its own
        import tempfile

        try:
            os.rmdir(tempfile.mkdtemp(prefix=".ssl_engine_probe_", dir=str(probe)))
        except OSError as e:
            raise ConfigError(f"{named} cannot be created: {e.strerror or e} (in {probe})") from None


def check_hook_output_folders(cfg: AttrDict) -> None:
    """The folders that optional hooks of a training run write to (TensorBoard's events, the
    profiler's traces) can be made. The hooks make them at their first write, after the run had
    made its checkpoint folder, log.txt and train_config.yaml: a file in the way was found there."""
    from ssl_engine.hooks.profiler import profiling_folder
    from ssl_engine.hooks.tensorboard import events_in_checkpoint_dir, tensorboard_dir

    tb = cfg.HOOKS.TENSORBOARD_SETUP
    if tb.USE_TENSORBOARD:
        key, given = (("config.CHECKPOINT.DIR", cfg.CHECKPOINT.DIR) if events_in_checkpoint_dir(cfg)
                      else ("config.HOOKS.TENSORBOARD_SETUP.LOG_DIR", tb.LOG_DIR))
        check_output_folder(tensorboard_dir(cfg), key, value=given)
    if cfg.PROFILING.RUNTIME_PROFILING.USE_PROFILER:
        check_output_folder(profiling_folder(cfg), "config.PROFILING.OUTPUT_FOLDER", value=cfg.PROFILING.OUTPUT_FOLDER)


def is_resuming(cfg: AttrDict) -> bool:
    """True when a training run would continue from a checkpoint rather than start anew."""
    from ssl_engine.checkpoint import list_checkpoints

    if cfg.CHECKPOINT.RESUME_FROM:
        return True
    return bool(cfg.CHECKPOINT.AUTO_RESUME) and bool(list_checkpoints(Path(str(cfg.CHECKPOINT.DIR)).expanduser()))


def check_pointer_is_not_a_folder(folder: Any) -> None:
    """A folder where the checkpoint pointer goes (``checkpoint.torch``) would stop the run at its
    first checkpoint, after the training up to there; say so before any process starts."""
    from ssl_engine.checkpoint import POINTER, checkpoint_entries

    pointer = Path(str(folder)).expanduser() / POINTER
    if pointer.is_dir() and not pointer.is_symlink():
        raise ConfigError(f"config.CHECKPOINT.DIR {folder}: {pointer} is a folder, not the run's checkpoint pointer "
                          f"(a file the run replaces at each checkpoint); move or remove it")
    # so is a folder under a checkpoint's name (model_phase3.torch/): the run would stop at that
    # checkpoint, after training up to it
    for name in checkpoint_entries(pointer.parent):
        path = pointer.parent / name.split(" ")[0]
        if path.is_dir() and not path.is_symlink():
            raise ConfigError(f"config.CHECKPOINT.DIR {folder}: {path} is a folder, not a checkpoint (a file the run "
                              f"writes at a checkpoint of that name); move or remove it")


def check_resume_file(cfg: AttrDict) -> None:
    """CHECKPOINT.RESUME_FROM names an ssl_engine training checkpoint that loads without code."""
    from ssl_engine.checkpoint import check_intact, is_engine_checkpoint, peek_checkpoint, resume_from_file
    from ssl_engine.errors import CheckpointError
    from ssl_engine.resume_state import state_problem

    if not cfg.CHECKPOINT.RESUME_FROM:
        return
    path = resume_from_file(cfg.CHECKPOINT.RESUME_FROM)
    try:
        data = peek_checkpoint(path)
    except CheckpointError as e:  # say which setting names the file
        raise CheckpointError(f"config.CHECKPOINT.RESUME_FROM: {e}") from None
    check_intact(path, "config.CHECKPOINT.RESUME_FROM")  # before any folder or log file is made
    if cfg.engine_name != "train":
        return
    if not is_engine_checkpoint(data):
        keys = ", ".join(map(str, list(data)[:8])) or "none"
        raise CheckpointError(
            f"config.CHECKPOINT.RESUME_FROM: {path} is not an ssl_engine training checkpoint (top-level keys: {keys}); "
            f"to start a new run from its weights use config.MODEL.WEIGHTS_INIT.PARAMS_FILE"
        )
    problem = state_problem(data)
    if problem:
        raise CheckpointError(f"config.CHECKPOINT.RESUME_FROM: {path}: {problem}; to start a new run from its weights "
                              f"use config.MODEL.WEIGHTS_INIT.PARAMS_FILE")


class _Quiet:
    """Silence logging and python warnings while parts are built only to be checked."""

    def __enter__(self) -> "_Quiet":
        import warnings

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.disable(self._previous)
        self._warnings.__exit__(*exc)


def _checked(what: str, build: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``build``; a UserError propagates, anything else returns None (the rank will say it)."""
    from ssl_engine.errors import UserError

    try:
        return build(*args, **kwargs)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - not a user error, or an artefact of building on meta
        log.debug("pre-launch check of %s skipped: %s: %s", what, type(e).__name__, e)
        return None


def check_labels_given(cfg: AttrDict, splits: List[str], loss: Any, meters: List[Any]) -> None:
    """A loss or meter that scores class labels (``needs_labels``) needs every split it runs on to
    give them: a split with no LABEL_SOURCES and LABEL_TYPE standard gives batches without labels.
    The loss runs in train and test phases, meters in test phases (and in train phases with
    METERS.enable_training_meter)."""
    for split in splits:
        d = cfg.DATA[split]
        if d.LABEL_SOURCES or str(d.get("LABEL_TYPE", "standard")) != "standard":
            continue
        from ssl_engine.data.transforms import labelling_transform
        from ssl_engine.models.label_range import label_scorers

        if labelling_transform(d.get("TRANSFORMS", []), every_entry=True):
            continue  # a transform gives each sample its label (ImgRotatePil)

        users = [f"config.LOSS.name={cfg.LOSS.name}" if s is loss else f"the meter {s.name}"
                 for s in label_scorers(cfg, split, loss, meters, flag="needs_labels")]
        if users:
            raise ConfigError(
                f"{' and '.join(users)} score{'s' if len(users) == 1 else ''} class labels, but "
                f"config.DATA.{split}.LABEL_SOURCES is empty, so the {split.lower()} batches have none: "
                f"name where they come from (e.g. LABEL_SOURCES: [disk_folder] for class folders, as many "
                f"entries as DATA_SOURCES), or set config.DATA.{split}.LABEL_TYPE=sample_index or zero"
                f"{'' if split == 'TEST' else ', or use a loss and meters that need none'}"
            )


def check_heads_are_run(model: Any) -> None:
    """A training run (its train and test phases) scores the model's forward output. With
    ``EXTRACT_TRUNK_FEATURES_ONLY`` (and ``EVAL_MODE_ON``) that output is the trunk's features and
    no head runs: heads given beside it would never be trained nor tested, and the loss would
    read features as class scores (a shape error at the first step, or a loss over the feature
    dimensions). Say so before launch, naming the keys."""
    heads = getattr(model, "heads", None)
    if not getattr(model, "trunk_features_only", False) or heads is None or len(heads) == 0:
        return
    fes = "config.MODEL.FEATURE_EVAL_SETTINGS"
    raise UserError(
        f"{fes}.EXTRACT_TRUNK_FEATURES_ONLY=true (with EVAL_MODE_ON=true) makes the model output trunk features "
        f"and run none of the {len(heads)} heads of config.MODEL.HEAD.PARAMS, so this run would train and test "
        f"no head; set {fes}.EXTRACT_TRUNK_FEATURES_ONLY=false to train the heads, or extract the features with "
        f"engine_name=extract_features"
    )


def check_no_batch_of_one(cfg: AttrDict, model: Any, loader: Any, world_size: int) -> None:
    """A last TRAIN batch of one sample on a model with a training BatchNorm1d (a projection
    head's, an mlp trunk's) fails at that step, after an epoch of work: say so before launch.
    (BatchNorm2d fails only where the map is 1x1, which the input size decides: left to the run;
    SyncBatchNorm across several ranks normalises over their batches together and takes it.)"""
    import torch.nn as nn

    from ssl_engine.models.model import sync_bn_group_size
    from ssl_engine.train_steps.standard_train_step import one_sample_batch_error

    data = cfg.DATA.TRAIN
    if data.DROP_LAST:
        return
    sync = cfg.MODEL.SYNC_BN_CONFIG
    if sync.CONVERT_BN_TO_SYNC_BN and world_size > 1 and sync_bn_group_size(
            int(sync.GROUP_SIZE), world_size, int(cfg.DISTRIBUTED.NUM_PROC_PER_NODE)) > 1:
        return
    names = [str(t.get("name", "")) if isinstance(t, dict) else "" for t in data.get("TRANSFORMS") or []]
    if any("Replicate" in n or "MultiCrop" in n for n in names):
        return  # several views of each sample reach the layers: a one-sample batch is several rows
    per_rank, batch = len(loader.sampler), int(data.BATCHSIZE_PER_REPLICA)
    if batch != 1 and per_rank % batch != 1:
        return
    model.train()  # frozen parts stay in eval mode (SSLModel.train), where BatchNorm takes any batch
    layers = [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm1d) and m.training]
    if layers:
        raise one_sample_batch_error(cfg, "TRAIN", per_rank, 1,
                                     f"the model's BatchNorm1d layer {layers[0]!r} cannot train on one value per channel")


def check_loss_batch(cfg: AttrDict, loss: Any, loader: Any, world_size: int) -> Optional[str]:
    """A loss that compares the images of a step with each other (``min_global_batch``: Barlow
    Twins standardises over them, SimCLR takes its negatives from them) gives no gradient to a
    step of one image: refuse a batch that small before launch; return the warning for a last
    batch that small (logged once the checks are done: they run with logging silenced). A loss
    with ``check_global_batches(batch, last, world_size)`` is given the global batch and the
    short last one of an epoch (0 where there is none), and raises for a size it cannot take."""
    need = int(getattr(loss, "min_global_batch", 1))
    data = cfg.DATA.TRAIN
    batch = int(data.BATCHSIZE_PER_REPLICA)
    name = cfg.LOSS.name
    if batch * world_size < need:
        raise UserError(
            f"config.LOSS.name={name} compares the images of a step with each other and needs at least {need} "
            f"per step; config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={batch} x {world_size} rank(s) gives "
            f"{batch * world_size}, whose loss has no gradient: raise BATCHSIZE_PER_REPLICA"
        )
    last = (len(loader.sampler) % batch) * world_size if loader is not None and not data.DROP_LAST else 0
    check_batches = getattr(loss, "check_global_batches", None)
    if callable(check_batches) and loader is not None:  # e.g. moco_loss: its queue takes whole steps of keys
        full = batch * world_size if len(loader.sampler) >= batch else 0
        check_batches(full, last, world_size)
    if need > 1 and 0 < last < need:
        return (f"config.DATA.TRAIN: the last batch of each epoch holds {last} image(s), which {name} gives no "
                f"gradient; config.DATA.TRAIN.DROP_LAST=true leaves it out")
    return None


def first_samples(datasets: Dict[str, Any]) -> Dict[str, Any]:
    """Each split's first sample, through its transforms. A UserError the run would raise on it
    (a transform whose settings fail on an image, no readable image under the split's
    ON_CORRUPT_IMAGE policy) is raised here, before launch; a split whose first sample fails
    otherwise is left out, for the run to report with its traceback."""
    samples = {}
    for split, dataset in datasets.items():
        try:
            if len(dataset):
                samples[split] = dataset[0]
        except UserError:
            check_source_entries(dataset, split)  # a source that gives no image: its error, not the transform's
            raise
        except Exception:  # noqa: BLE001
            continue
    return samples


def check_source_entries(dataset: Any, split: str) -> None:
    """Each data source's ``get`` of the split's first sample gives an image (a PIL image, or a
    tensor or array when no transform needs an image): anything else (a path string, None) is a
    UserError naming the source, not the first transform's or the collator's error, which would
    blame their settings. Called once that first sample has failed (it reads the sample again). A
    ``get`` that raises is left to the run's own reading of the sample."""
    import numpy as np
    import torch
    from PIL import Image

    from ssl_engine.registry import part_origin

    sources = list(getattr(dataset, "sources", []) or [])
    names = list(getattr(dataset, "source_names", []) or [])
    index_of = getattr(dataset, "source_index", None)
    if not sources or not callable(index_of):
        return
    for j, src in enumerate(sources):
        try:
            entry = src.get(index_of(0))
        except Exception:  # noqa: BLE001 - an unreadable image and the like: the sample's own reading says it
            continue
        if not isinstance(entry, (Image.Image, torch.Tensor, np.ndarray)):
            name = names[j] if j < len(names) else type(src).__name__
            raise UserError(
                f"config.DATA.{split}.DATA_SOURCES[{j}]: data source {name!r} {part_origin(type(src))} returned a "
                f"{type(entry).__name__} from get({index_of(0)}); get returns the sample's image (a PIL image, or a "
                f"tensor when no transform needs an image)"
            )


def check_samples_batch(samples: Dict[str, Any], loaders: Dict[str, Any]) -> Dict[str, Any]:
    """Each split's collator takes its first sample (twice, as a batch of two): a split whose
    transforms do not end in tensors (a TEST list without ToTensor) is the collator's one-line
    error before launch, not after a whole train phase has run. Returns those batches."""
    batches = {}
    for split, sample in samples.items():
        loader = loaders.get(split)
        if loader is not None:
            try:
                batch = _checked(f"a batch of the {split} data", loader.collate_fn, [sample, sample])
            except UserError:
                check_source_entries(getattr(loader, "dataset", None), split)  # no image to batch: the source's error
                raise
            if batch is not None:
                batches[split] = batch
    return batches


def inputs_origin(cfg: AttrDict, split: str, fix: str) -> str:
    """Which keys give a split several inputs per sample: several DATA_SOURCES (one input
    each), or view-making TRANSFORMS / COLLATE_FUNCTION (``fix`` says what to do about those)."""
    sources = list(cfg.DATA[split].DATA_SOURCES)
    if len(sources) > 1:
        return (f"config.DATA.{split}.DATA_SOURCES={show_value(sources)} (one input per data source; VISSL's "
                f"MULTI_INPUT_HEAD_MAPPING, which sends each to its own head, is not implemented: use one data source)")
    return f"config.DATA.{split}.TRANSFORMS / COLLATE_FUNCTION (views made by ImgReplicatePil / multi-crop transforms: {fix})"


def check_label_per_row(cfg: AttrDict, loss: Any, batches: Dict[str, Any]) -> None:
    """A loss whose target is one class per output row (cross-entropy) gets one label tensor with
    a label for each row the model outputs. The model concatenates a sample's inputs along the
    batch (multi-crop), so a split with several inputs per sample (two DATA_SOURCES, replicated
    views without a collator that replicates the labels too) gives more rows than labels: the
    loss's shape error in the first step, which is refused here, naming the keys."""
    import torch

    if not getattr(loss, "class_index_targets", False):
        return
    for split, batch in batches.items():
        labels, data = batch.get("label"), batch.get("data")
        if not isinstance(labels, list) or not isinstance(data, list) or not labels:
            continue
        name = f"config.LOSS.name={cfg.LOSS.name}"
        label_sources = list(cfg.DATA[split].LABEL_SOURCES)
        if len(labels) > 1 and len(label_sources) > 1:
            sources = list(cfg.DATA[split].DATA_SOURCES)
            also = (f"; and config.DATA.{split}.DATA_SOURCES={show_value(sources)} gives the model {len(sources)} "
                    f"inputs per sample, one label each: use one data source too") if len(sources) > 1 else ""
            raise UserError(
                f"config.DATA.{split}.LABEL_SOURCES={show_value(label_sources)} gives {len(labels)} labels per "
                f"sample; {name} takes one: name one label source{also}"
            )
        label = labels[0]
        if not isinstance(label, torch.Tensor) or label.ndim < 1 or not all(isinstance(t, torch.Tensor) and t.ndim
                                                                            for t in data):
            continue
        rows = sum(int(t.shape[0]) for t in data)
        if len(labels) > 1 or rows != int(label.shape[0]):  # several views, each with its copy of the label
            per = len(data) if len(data) > 1 else rows / max(1, int(label.shape[0]))
            raise UserError(
                f"config.DATA.{split} gives the model {per:g} inputs per sample and one label, so {name}, which "
                f"needs a label per output row, would fail at the first step; the inputs come from "
                f"{inputs_origin(cfg, split, 'remove them, or use a loss made for several views')}"
            )


def check_model_runs_on_samples(model: Any, samples: Dict[str, Any]) -> None:
    """The model takes the data: on the meta device it runs on a batch of the shape of each
    split's first sample (the transforms decide it), so a head whose input size does not match
    a trunk of your own, or a LINEAR_EVAL_FEAT_POOL_OPS_MAP op larger than its layer at this image
    size (a 6x6 kernel over a 2x2 res4), is the model's own one-line error before launch, not
    after the run has started in its folder. An op without a meta kernel skips the check (the
    run's first step makes it)."""
    import torch

    shapes = []
    for sample in samples.values():  # each split: their transforms may give other sizes
        try:
            first = sample["data"][0]
        except Exception:  # noqa: BLE001 - a sample without views is the run's to report
            continue
        if isinstance(first, torch.Tensor) and first.ndim == 3 and tuple(first.shape) not in shapes:
            shapes.append(tuple(first.shape))
    was_training = model.training
    model.eval()
    try:
        for shape in shapes:
            with torch.no_grad():
                model(torch.empty((2,) + shape, device="meta"))
    except UserError:
        raise
    except Exception:  # noqa: BLE001 - an op without a meta kernel: the run checks at its first step
        return
    finally:
        model.train(was_training)


def check_custom_hooks(cfg: AttrDict) -> None:
    """HOOKS.CUSTOM params fit their hook's constructor (checked by signature, nothing is built)."""
    import inspect

    from ssl_engine.errors import UserError
    from ssl_engine.hooks.base import parse_priority
    from ssl_engine.registry import HOOKS

    for i, entry in enumerate(cfg.HOOKS.CUSTOM):
        if entry.get("priority") is not None:
            parse_priority(entry["priority"], f"config.HOOKS.CUSTOM[{i}].priority")
        cls = HOOKS.get(entry["name"])
        params = dict(entry.get("params") or {})
        check_hook_state_methods(cls, f"config.HOOKS.CUSTOM[{i}]", str(entry["name"]))
        try:
            inspect.signature(cls).bind(**params)
        except TypeError as e:
            raise UserError(f"config.HOOKS.CUSTOM hook {entry['name']!r}: bad params {params}: {e}") from None
        except ValueError:
            continue  # no signature to check against


def check_hook_state_methods(cls: Any, key: str, name: str) -> None:
    """A hook class that defines one of get_classy_state / set_classy_state without the other
    is a UserError: with get alone its state is saved but never put back on resume (the base
    class's setter keeps it elsewhere), with set alone nothing of it is saved."""
    from classy_vision.hooks.classy_hook import ClassyHook

    from ssl_engine.hooks.base import SSLHook
    from ssl_engine.registry import part_origin

    def defines(attr: str) -> bool:
        for klass in getattr(cls, "__mro__", ()):
            if klass in (SSLHook, ClassyHook, object):
                return False
            if attr in vars(klass):
                return True
        return False

    has_get, has_set = defines("get_classy_state"), defines("set_classy_state")
    if has_get != has_set:
        given, lacking = ("get_classy_state", "set_classy_state") if has_get else ("set_classy_state", "get_classy_state")
        raise UserError(
            f"{key} hook {name!r} {part_origin(cls)} defines {given} but not {lacking}: its state would "
            f"{'be saved in checkpoints but not restored on resume' if has_get else 'never be saved'}; define both"
        )


def check_parts_build(cfg: AttrDict, world_size: int) -> None:
    """Build what each rank builds, cheaply, so that its user errors come before any process
    starts: datasets (sizes and labels; no image is decoded), loaders (batch size against
    DROP_LAST and the world size), the model on the meta device (heads against the trunk's
    dimensions, the data's labels against the heads' classes), the weights file's names against
    it, the loss, meters and optimizer.

    Only UserErrors are reported here; any other failure is left for the run to show with its
    traceback.
    """
    check_custom_hooks(cfg)
    with _Quiet():
        if cfg.engine_name == "train":
            from ssl_engine.hooks import default_hooks

            _checked("the hooks", default_hooks, cfg, custom=False)  # their settings (EMA decay, PreciseBN batches...)
        notes = _build_parts(cfg, world_size)
    for note in notes or []:
        log.warning("%s", note)


def _build_parts(cfg: AttrDict, world_size: int) -> Optional[List[str]]:
    """The checks of check_parts_build; returns the warnings they found."""
    import torch

    from ssl_engine.data import build_dataloader, build_dataset
    from ssl_engine.losses import build_loss
    from ssl_engine.meters import build_meters
    from ssl_engine.models import build_model
    from ssl_engine.registry import TASKS
    from ssl_engine.tasks.self_supervision_task import SelfSupervisionTask

    if cfg.engine_name == "train":
        task_cls = TASKS.get(cfg.TRAINER.TASK_NAME)
        if not (isinstance(task_cls, type) and issubclass(task_cls, SelfSupervisionTask)):
            return  # a user task builds its own parts
        task = _checked("the task", task_cls, cfg)
        if task is None:
            return
        splits = task.needed_splits()
        build_cfg = cfg
    elif cfg.engine_name == "extract_features":
        from ssl_engine.engines.extract_features import extraction_config, extraction_splits

        splits = extraction_splits(cfg)
        build_cfg = extraction_config(cfg)
    else:
        return
    loaders, datasets = {}, {}
    data_errors: List[str] = []
    for split in splits:
        try:  # every split's data is checked: a bad TEST path is told with the TRAIN one, not on the next run
            dataset = _checked(f"the {split} data", build_dataset, build_cfg, split)
        except UserError as e:
            data_errors.append(str(e))
            continue
        if dataset is not None:
            datasets[split] = dataset
            loaders[split] = _checked(
                f"the {split} loader", build_dataloader, dataset, build_cfg, split, 0, world_size, "cpu",
                check_cpus=False,  # the ranks may run on other machines (SLURM); they check their own CPUs
            )
    if data_errors:
        raise UserError("; and ".join(dict.fromkeys(data_errors)))  # one problem found twice is told once
    notes: List[Optional[str]] = []
    if loaders and not cfg.SLURM.USE_SLURM:  # the ranks start on this machine (each node runs the tool itself)
        from ssl_engine.data.loader import check_num_workers, worker_count_note

        check_num_workers(int(build_cfg.DATA.NUM_DATALOADER_WORKERS))
        notes.append(worker_count_note(int(build_cfg.DATA.NUM_DATALOADER_WORKERS),
                                       max(1, world_size // max(1, int(build_cfg.DISTRIBUTED.NUM_NODES)))))
    with torch.device("meta"):
        model = _checked("the model", build_model, build_cfg.MODEL, build_cfg.OPTIMIZER)
        loss = _checked("the loss", build_loss, build_cfg.LOSS)
    meters = _checked("the meters", build_meters, build_cfg.METERS)
    if cfg.engine_name == "train":
        check_labels_given(build_cfg, splits, loss, meters or [])
        if build_cfg.HOOKS.BEST_CHECKPOINT.METRIC:
            from ssl_engine.hooks.best_checkpoint import check_metric_before_launch

            check_metric_before_launch(build_cfg, meters, splits)
    samples = first_samples(datasets)
    batches = check_samples_batch(samples, loaders)
    if cfg.engine_name == "train" and loss is not None:
        check_label_per_row(build_cfg, loss, batches)
    if cfg.engine_name == "train" and loaders.get("TRAIN") is not None:
        notes.append(_checked("the batch size against the loss", check_loss_batch, build_cfg, loss, loaders["TRAIN"],
                              world_size))
    if model is None:
        return [n for n in notes if n]
    if cfg.engine_name == "train":
        check_heads_are_run(model)
    _checked("the model on the data's first samples", check_model_runs_on_samples, model, samples)
    if cfg.engine_name == "train" and loaders.get("TRAIN") is not None:
        check_no_batch_of_one(build_cfg, model, loaders["TRAIN"], world_size)
    if cfg.engine_name == "train" and build_cfg.MODEL.get("TEMP_FROZEN_PARAMS_ITER_MAP"):
        from ssl_engine.hooks.frozen_params import frozen_params, parse_iter_map

        frozen_params(parse_iter_map(build_cfg.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP), model)
    check_model = getattr(loss, "check_model", None)
    if cfg.engine_name == "train" and callable(check_model):
        _checked("the loss against the model", check_model, model)  # e.g. swav_loss against the swav_head
    if cfg.engine_name == "train":
        from ssl_engine.models.label_range import check_dataset_labels

        # the only help on CUDA, where a label beyond the head's classes is an uncatchable device assert
        check_dataset_labels(build_cfg, datasets, model, loss, meters or [])
        if "TEST" in datasets and loaders.get("TEST") is not None:
            from ssl_engine.models.label_range import check_ordered_batches_labelled

            check_ordered_batches_labelled(build_cfg, "TEST", datasets["TEST"], loaders["TEST"].sampler, loss)
        if meters and any(split == "TEST" or build_cfg.METERS.enable_training_meter for split in splits):
            from ssl_engine.meters import check_meters_fit_model

            # the meters' own check of every update, on the heads' sizes: num_meters, top-k against the classes
            check_meters_fit_model(meters, model)
    weights = build_cfg.MODEL.WEIGHTS_INIT
    if weights.PARAMS_FILE and (cfg.engine_name != "train" or not is_resuming(cfg)):
        from ssl_engine.checkpoint import init_model_from_weights

        _checked("the weights file", init_model_from_weights, model, build_cfg.MODEL)
    if cfg.engine_name == "train" and loaders.get("TRAIN") is not None:
        from ssl_engine.optim import build_optimizer

        global_bs = build_cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * world_size
        _checked("the optimizer", build_optimizer, build_cfg.OPTIMIZER, model, global_bs, len(loaders["TRAIN"]),
                 max(1, int(build_cfg.DISTRIBUTED.NUM_NODES)))
    return [n for n in notes if n]
