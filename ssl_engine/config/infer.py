"""Values VISSL infers from other keys, so that VISSL's yaml files mean the same here.

Run at the end of validation, on the plain config dict (no torch needed), so that every rank,
the pre-launch checks and ``train_config.yaml`` see the inferred values.

``swav_loss`` (as VISSL's ``infer_losses_config``): ``num_crops`` from the TRAIN transforms
(``ImgPilToMultiCrop``'s ``total_num_crops``, or ``ImgReplicatePil``'s ``num_times``),
``num_prototypes`` and ``embedding_dim`` from the swav_head's ``num_clusters`` and ``dims[-1]``,
each when the yaml left it at its default; one set to another value that contradicts the
source is an error naming both keys (VISSL overwrites it silently). ``queue.queue_length`` is
rounded down to a multiple of the global batch and ``queue.local_queue_length`` set to its
share per rank, as VISSL does.

``multicrop_simclr_info_nce_loss``: ``num_crops`` from the TRAIN transforms in the same way.

Meters of a feature-evaluation model (as VISSL's ``infer_and_assert_hydra_config``): when
``MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON`` and ``FREEZE_TRUNK_ONLY`` or
``EXTRACT_TRUNK_FEATURES_ONLY`` are set and ``LINEAR_EVAL_FEAT_POOL_OPS_MAP`` is not empty, every
list meter named in ``METERS.name`` / ``METERS.names`` (:data:`LIST_METERS`) gets
``num_meters = len(map)`` and ``meter_names = [the map's layer names]``, so that metrics.json keys
the values by layer (``test_accuracy_list_meter/top_1/res5``). Like VISSL, this overwrites what the
yaml says (VISSL's own linear-eval configs say ``num_meters: 1`` with two heads); a changed value
is logged.

Head optimizer settings (as VISSL's ``infer_learning_rate``): without
``OPTIMIZER.head_optimizer_params.use_different_lr`` the heads' schedule
``param_schedulers.lr_head`` is a copy of ``lr`` (auto-scaling included, since scaling happens
when the optimizer is built, for each schedule by its own ``auto_lr_scaling``); without
``use_different_wd`` the heads' ``weight_decay`` is ``OPTIMIZER.weight_decay``.
"""

import copy
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ssl_engine.errors import ConfigError, whole_number

log = logging.getLogger(__name__)

KEY = "config.LOSS.swav_loss"


def _swav_head(cfg: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(config key, params) of the swav_head the model ends with, or None."""
    params = ((cfg.get("MODEL") or {}).get("HEAD") or {}).get("PARAMS") or []
    if not isinstance(params, list) or not params:
        return None
    where, last = f"config.MODEL.HEAD.PARAMS[{len(params) - 1}]", params[-1]
    if isinstance(last, (list, tuple)) and last and isinstance(last[0], (list, tuple)):
        where, last = f"{where}[{len(last) - 1}]", last[-1]  # a chain of stages: its last one
    if (
        isinstance(last, (list, tuple)) and len(last) == 2 and last[0] in ("swav_head", "swav_head_fsdp")
        and isinstance(last[1], dict)
    ):
        return where, last[1]
    return None


def _crops_per_image(cfg: Dict[str, Any]) -> Optional[Tuple[str, int]]:
    """(where it is set, number of views) the TRAIN transforms give each image, or None."""
    found = None
    transforms = ((cfg.get("DATA") or {}).get("TRAIN") or {}).get("TRANSFORMS") or []
    for i, t in enumerate(transforms if isinstance(transforms, list) else []):
        if not isinstance(t, dict):
            continue
        where = f"config.DATA.TRAIN.TRANSFORMS[{i}] ({t.get('name')})"
        if t.get("name") == "ImgPilToMultiCrop" and whole_number(t.get("total_num_crops")) is not None:
            found = (f"{where}.total_num_crops", whole_number(t["total_num_crops"]))
        elif t.get("name") == "ImgReplicatePil" and whole_number(t.get("num_times", 2)) is not None:
            found = (f"{where}.num_times", whole_number(t.get("num_times", 2)))
    return found


def _take(section: Dict[str, Any], default: Dict[str, Any], key: str, value: Any, source: str,
          where: str = KEY) -> None:
    """Set ``section[key]`` to ``value`` (from ``source``) when it holds its default; a different
    value given on purpose must agree (``where``: the section's config path)."""
    if section.get(key) == default.get(key):
        section[key] = value
    elif section.get(key) != value:
        raise ConfigError(
            f"{where}.{key}={section.get(key)!r} contradicts {source}={value!r}; make them equal, or leave "
            f"{where}.{key} out to take it from there"
        )


def infer_swav_loss(cfg: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """Fill ``config.LOSS.swav_loss`` from the head, the transforms and the batch (in place)."""
    loss = cfg.get("LOSS") or {}
    if loss.get("name") != "swav_loss" or not isinstance(loss.get("swav_loss"), dict):
        return
    sw, default = loss["swav_loss"], defaults["LOSS"]["swav_loss"]
    head = _swav_head(cfg)
    if head is not None:
        where, params = head
        clusters = params.get("num_clusters")
        if isinstance(clusters, int) and not isinstance(clusters, bool):
            clusters = [clusters]
        if isinstance(clusters, list):
            _take(sw, default, "num_prototypes", clusters, f"{where}.num_clusters")
        dims = params.get("dims")
        if isinstance(dims, list) and dims and isinstance(dims[-1], int):
            _take(sw, default, "embedding_dim", dims[-1], f"{where}.dims[-1]")
    crops = _crops_per_image(cfg)
    if crops is not None:
        _take(sw, default, "num_crops", crops[1], crops[0])
    queue = sw.get("queue")
    if not isinstance(queue, dict):
        return
    dist = cfg.get("DISTRIBUTED") or {}
    try:
        world = max(1, int(dist.get("NUM_NODES", 1)) * int(dist.get("NUM_PROC_PER_NODE", 1)))
        global_batch = int(cfg["DATA"]["TRAIN"]["BATCHSIZE_PER_REPLICA"]) * world
        length = int(queue.get("queue_length", 0))
    except (KeyError, TypeError, ValueError):
        return
    if length > 0 and global_batch > 0:
        rounded = length - length % global_batch
        if rounded != length:
            log.warning("%s.queue.queue_length=%d is rounded down to %d, a multiple of the global batch %d%s",
                        KEY, length, rounded, global_batch, " (no queue)" if rounded == 0 else "")
        queue["queue_length"] = rounded
        queue["local_queue_length"] = rounded // world
    else:
        queue["local_queue_length"] = 0


def infer_multicrop_simclr_loss(cfg: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """``config.LOSS.multicrop_simclr_info_nce_loss.num_crops`` from the TRAIN transforms (in place)."""
    loss = cfg.get("LOSS") or {}
    name = "multicrop_simclr_info_nce_loss"
    if loss.get("name") != name or not isinstance(loss.get(name), dict):
        return
    crops = _crops_per_image(cfg)
    if crops is not None:
        _take(loss[name], defaults["LOSS"][name], "num_crops", crops[1], crops[0], where=f"config.LOSS.{name}")


#: VISSL's list meters whose count and names follow the evaluated layers (mean_ap_list_meter is
#: not implemented here, but its section is filled in too, as VISSL does).
LIST_METERS = ("accuracy_list_meter", "mean_ap_list_meter", "precision_at_k_list_meter", "recall_at_k_list_meter")


def is_feature_eval_model(model_cfg: Dict[str, Any]) -> bool:
    """VISSL's ``is_feature_extractor_model``: EVAL_MODE_ON, a frozen trunk (FREEZE_TRUNK_ONLY) or
    trunk features only (EXTRACT_TRUNK_FEATURES_ONLY), and a non-empty LINEAR_EVAL_FEAT_POOL_OPS_MAP."""
    fe = (model_cfg or {}).get("FEATURE_EVAL_SETTINGS") or {}
    return bool(
        fe.get("EVAL_MODE_ON")
        and (fe.get("FREEZE_TRUNK_ONLY") or fe.get("EXTRACT_TRUNK_FEATURES_ONLY"))
        and isinstance(fe.get("LINEAR_EVAL_FEAT_POOL_OPS_MAP"), list)
        and len(fe["LINEAR_EVAL_FEAT_POOL_OPS_MAP"]) > 0
    )


def _named_meters(meters: Dict[str, Any]) -> List[str]:
    names = meters.get("names") or []
    names = [names] if isinstance(names, str) else list(names) if isinstance(names, list) else []
    single = meters.get("name") or ""
    if isinstance(single, str) and single and single not in names:
        names.append(single)
    return [str(n) for n in names]


def feature_output_names(layers: Sequence[str]) -> List[str]:
    """The names of LINEAR_EVAL_FEAT_POOL_OPS_MAP's outputs (their meter values, their extracted
    features): each entry's layer name, and for a layer the map lists again (several heads on one
    layer, with other pool ops or settings, as VISSL's MobileNet linear evaluation does)
    ``<layer>_1``, ``<layer>_2``, ..., so that no entry's value or file hides another's."""
    seen: Dict[str, int] = {}
    names = []
    for layer in layers:
        count = seen.get(layer, 0)
        names.append(layer if count == 0 else f"{layer}_{count}")
        seen[layer] = count + 1
    return names


def infer_meters(cfg: Dict[str, Any]) -> None:
    """num_meters / meter_names of the list meters from LINEAR_EVAL_FEAT_POOL_OPS_MAP (in place)."""
    meters = cfg.get("METERS")
    if not isinstance(meters, dict) or not is_feature_eval_model(cfg.get("MODEL") or {}):
        return
    pool_map = cfg["MODEL"]["FEATURE_EVAL_SETTINGS"]["LINEAR_EVAL_FEAT_POOL_OPS_MAP"]
    layers = feature_output_names(
        [str(entry[0]) if isinstance(entry, (list, tuple)) and entry else str(entry) for entry in pool_map])
    for name in _named_meters(meters):
        if name not in LIST_METERS:
            continue
        section = meters.get(name)
        if not isinstance(section, dict):
            section = meters[name] = {}
        before = (section.get("num_meters"), list(section.get("meter_names") or []))
        section["num_meters"] = len(layers)
        section["meter_names"] = list(layers)
        if (before[1] and before[1] != layers) or before[0] not in (None, 1, len(layers)):
            log.info(
                "config.METERS.%s: num_meters=%s, meter_names=%s replaced by %d, %s from "
                "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP (as VISSL infers them)",
                name, before[0], before[1], len(layers), layers,
            )


def infer_head_optimizer(cfg: Dict[str, Any]) -> None:
    """``param_schedulers.lr_head`` and ``head_optimizer_params.weight_decay`` when the heads use
    the trunk's values (in place)."""
    opt = cfg.get("OPTIMIZER")
    if not isinstance(opt, dict):
        return
    head = opt.get("head_optimizer_params")
    if not isinstance(head, dict):
        head = opt["head_optimizer_params"] = {}
    schedulers = opt.get("param_schedulers")
    if isinstance(schedulers, dict) and not head.get("use_different_lr", False) and "lr" in schedulers:
        schedulers["lr_head"] = copy.deepcopy(schedulers["lr"])
    if not head.get("use_different_wd", False):
        head["weight_decay"] = opt.get("weight_decay", 0.0)


def infer_settings(cfg: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """Every inference of this module, on the validated ``config`` node (in place)."""
    infer_swav_loss(cfg, defaults)
    infer_multicrop_simclr_loss(cfg, defaults)
    infer_meters(cfg)
    infer_head_optimizer(cfg)


__all__: List[str] = [
    "infer_head_optimizer", "infer_meters", "infer_multicrop_simclr_loss", "infer_settings", "infer_swav_loss",
    "is_feature_eval_model", "LIST_METERS",
]
