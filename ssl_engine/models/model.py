"""SSLModel: a trunk plus heads, built from ``config.MODEL`` the way VISSL builds its models.

Three ways the same model runs, chosen by ``MODEL.FEATURE_EVAL_SETTINGS``:

- training (default): the trunk's last layer goes through the heads one after the other
  (a head made of several stages is several entries of ``HEAD.PARAMS``); one output.
- linear evaluation (``EVAL_MODE_ON`` and a non-empty ``LINEAR_EVAL_FEAT_POOL_OPS_MAP``): the
  trunk returns each mapped layer, pooled by its op, and head i classifies layer i; one output
  per layer. Usually with ``FREEZE_TRUNK_ONLY`` so only the classifiers learn.
- feature extraction (:meth:`SSLModel.extract_features`): named, pooled trunk layers, or the
  heads' output, as a dict keyed by layer name.

Everything that can be checked without data (head input dims against the trunk, pool-op names,
layer names) is checked here, at build time, with a UserError naming the config key.
"""

import contextlib
import inspect
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.errors import UserError
from ssl_engine.models.param_names import match_params, no_such_params
from ssl_engine.config.infer import feature_output_names
from ssl_engine.models.pooling import POOL_OPS_KEY, parse_feat_pool_ops_map, pooled_positions
from ssl_engine.registry import HEADS, TRUNKS, accepted_params, check_call, part_origin

# what a torch.nn pool op raises on a feature map it does not fit: a kernel larger than the map
# (RuntimeError), too few dimensions (ValueError), a bad argument (TypeError), a dim out of range
POOL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)

logger = logging.getLogger(__name__)

Batch = Union[torch.Tensor, Sequence[torch.Tensor]]

HEAD_KEY = "config.MODEL.HEAD.PARAMS"


def _eval_settings(model_config: AttrDict) -> Dict[str, Any]:
    """FEATURE_EVAL_SETTINGS with VISSL's defaults for any missing key."""
    fe = model_config.get("FEATURE_EVAL_SETTINGS", {}) or {}
    return {
        "EVAL_MODE_ON": bool(fe.get("EVAL_MODE_ON", False)),
        "FREEZE_TRUNK_ONLY": bool(fe.get("FREEZE_TRUNK_ONLY", False)),
        "FREEZE_TRUNK_AND_HEAD": bool(fe.get("FREEZE_TRUNK_AND_HEAD", False)),
        "EXTRACT_TRUNK_FEATURES_ONLY": bool(fe.get("EXTRACT_TRUNK_FEATURES_ONLY", False)),
        "SHOULD_FLATTEN_FEATS": bool(fe.get("SHOULD_FLATTEN_FEATS", True)),
        "LINEAR_EVAL_FEAT_POOL_OPS_MAP": list(fe.get("LINEAR_EVAL_FEAT_POOL_OPS_MAP", []) or []),
    }


def build_trunk(model_config: AttrDict) -> nn.Module:
    """The trunk named by ``MODEL.TRUNK.NAME`` (default 'resnet'), built as ``cls(model_config, name)``."""
    name = (model_config.get("TRUNK", {}) or {}).get("NAME", "resnet")
    trunk_cls = TRUNKS.get(name)
    check_call(trunk_cls, (model_config, name), name, f"trunk {name!r} (config.MODEL.TRUNK.NAME)",
               "built as {}(model_config, model_name)", "a trunk's constructor takes the model config and its name")
    return trunk_cls(model_config, name)


def bad_trunk_output(trunk: nn.Module, name: str, out: Any) -> UserError:
    """The error for a trunk whose forward returned something other than a list of tensors."""
    if isinstance(out, (list, tuple)):
        got = f"a {type(out).__name__} of {', '.join(sorted({type(o).__name__ for o in out})) or 'nothing'}"
    elif isinstance(out, torch.Tensor):
        got = f"one tensor of shape {list(out.shape)}"
    else:
        got = type(out).__name__
    return UserError(
        f"trunk {name!r} (config.MODEL.TRUNK.NAME) {part_origin(type(trunk))} returned {got} from forward; a trunk "
        f"returns a list of feature tensors, e.g. [features] (one per layer asked for in out_feat_keys)"
    )


def _check_switches(signature: inspect.Signature, params: Dict[str, Any], where: str) -> None:
    """A UserError for a head option annotated ``bool`` that is given another value: a quoted
    ``use_bn: "false"`` is a non-empty string, which Python reads as true: the head was built
    with the BatchNorm layers the user turned off, and nothing said so (0 and 1 pass, as bools do)."""
    for key, value in params.items():
        param = signature.parameters.get(key)
        if param is None or param.annotation not in (bool, "bool") or isinstance(value, bool):
            continue
        if isinstance(value, int) and value in (0, 1):
            continue
        raise UserError(f"{where}: {key}={value!r} must be true or false")


def _build_head_module(model_config: AttrDict, spec: Any, where: str) -> Tuple[str, nn.Module]:
    """One ``[name, params]`` entry -> (name, module), checking the params against the constructor."""
    if not (
        isinstance(spec, (list, tuple))
        and len(spec) in (1, 2)
        and isinstance(spec[0], str)
        and (len(spec) == 1 or spec[1] is None or isinstance(spec[1], dict))
    ):
        raise UserError(
            f"{where} must be [head_name, {{params}}], e.g. ['mlp', {{'dims': [2048, 128]}}]; got {spec!r}"
        )
    name = spec[0]
    params = dict(spec[1] or {}) if len(spec) == 2 else {}
    head_cls = HEADS.get(name)
    try:
        signature = inspect.signature(head_cls)
        signature.bind(model_config, **params)
    except TypeError as err:
        accepted = accepted_params(head_cls, skip=1)  # after the model config
        raise UserError(
            f"{where}: bad params {sorted(params)} for head {name!r} ({err}); it accepts: {', '.join(accepted)}"
        ) from None
    _check_switches(signature, params, f"{where} ({name})")
    module = head_cls(model_config, **params)
    module.config_key = f"{where} ({name})"  # how run-time errors name it (see heads/mlp.py head_where)
    return name, module


def build_heads(model_config: AttrDict) -> Tuple[List[str], List[nn.Module]]:
    """The heads of ``MODEL.HEAD.PARAMS``: each entry ``[name, params]``, or a list of those run in sequence."""
    head_params = (model_config.get("HEAD", {}) or {}).get("PARAMS", []) or []
    if not isinstance(head_params, (list, tuple)):
        raise UserError(f"{HEAD_KEY} must be a list of [head_name, {{params}}] entries; got {head_params!r}")
    names: List[str] = []
    heads: List[nn.Module] = []
    for i, spec in enumerate(head_params):
        where = f"{HEAD_KEY}[{i}]"
        if isinstance(spec, (list, tuple)) and spec and isinstance(spec[0], (list, tuple)):
            parts = [_build_head_module(model_config, s, f"{where}[{j}]") for j, s in enumerate(spec)]
            names.append("->".join(n for n, _ in parts))
            heads.append(nn.Sequential(*[m for _, m in parts]))
        else:
            name, module = _build_head_module(model_config, spec, where)
            names.append(name)
            heads.append(module)
    return names, heads


def _warn_freeze_without_eval_mode(settings: Dict[str, Any]) -> None:
    """FREEZE_TRUNK_ONLY / FREEZE_TRUNK_AND_HEAD without EVAL_MODE_ON freeze nothing, as in VISSL,
    whose full fine-tuning trains the whole model whatever they say; the log names the keys, since
    a user who set them most likely meant the frozen trunk."""
    if settings["EVAL_MODE_ON"]:
        return
    fes = "config.MODEL.FEATURE_EVAL_SETTINGS"
    for key in ("FREEZE_TRUNK_ONLY", "FREEZE_TRUNK_AND_HEAD"):
        if settings[key]:
            logger.warning(
                "%s.%s=true freezes nothing without %s.EVAL_MODE_ON=true (as in VISSL): the trunk and heads train "
                "and the trunk's BatchNorm statistics move; set EVAL_MODE_ON=true to freeze them", fes, key, fes)


def _first_module(head: nn.Module) -> nn.Module:
    return head[0] if isinstance(head, nn.Sequential) and len(head) > 0 else head


class SSLModel(nn.Module):
    """Trunk + heads, with linear-evaluation, frozen-trunk and feature-extraction modes.

    Attributes: ``trunk``, ``heads`` (nn.ModuleList), ``head_names``, ``model_config``.
    State dict keys are ``trunk._feature_blocks.*`` and ``heads.<i>.*``, as in VISSL.
    """

    def __init__(self, model_config: AttrDict, optimizer_config: Optional[AttrDict] = None) -> None:
        super().__init__()
        self.model_config = model_config
        self.optimizer_config = optimizer_config
        self._settings = _eval_settings(model_config)
        settings = self._settings
        # plain attributes, not properties: the forward of every step reads them.
        # trunk_frozen: the trunk's params are frozen and it stays in eval mode (FREEZE_TRUNK_ONLY / _AND_HEAD);
        # heads_frozen: the heads too (FREEZE_TRUNK_AND_HEAD); trunk_features_only: EVAL_MODE_ON with
        # EXTRACT_TRUNK_FEATURES_ONLY, forward returns trunk features and no heads run.
        # As in VISSL, the FREEZE_* settings act only with EVAL_MODE_ON (see _warn_freeze_without_eval_mode)
        eval_on = settings["EVAL_MODE_ON"]
        self.trunk_frozen: bool = eval_on and bool(settings["FREEZE_TRUNK_ONLY"] or settings["FREEZE_TRUNK_AND_HEAD"])
        self.heads_frozen: bool = eval_on and bool(settings["FREEZE_TRUNK_AND_HEAD"])
        _warn_freeze_without_eval_mode(settings)
        self.trunk_features_only: bool = bool(settings["EVAL_MODE_ON"] and settings["EXTRACT_TRUNK_FEATURES_ONLY"])
        self.trunk = build_trunk(model_config)
        self.trunk_name: str = str((model_config.get("TRUNK", {}) or {}).get("NAME", "resnet"))
        names, heads = build_heads(model_config)
        self.head_names = names
        self.heads = nn.ModuleList(heads)

        valid_layers = self._trunk_feature_names()
        pool_map = parse_feat_pool_ops_map(self._settings["LINEAR_EVAL_FEAT_POOL_OPS_MAP"], valid_layers)
        self.feat_layer_names: List[str] = [layer for layer, _ in pool_map]
        # a layer the map lists again (several heads on it) names its features <layer>_1, ...
        self.feat_output_names: List[str] = feature_output_names(self.feat_layer_names)
        # Pool ops have no parameters, so they add nothing to the state dict.
        self.feat_pool_ops = nn.ModuleList([op for _, op in pool_map])
        self.linear_eval_mode = self._settings["EVAL_MODE_ON"] and bool(pool_map)
        self._check_heads()
        self._freeze()

    def _trunk_feature_names(self) -> Optional[List[str]]:
        names = getattr(self.trunk, "feature_names", None)
        if callable(names):
            return list(names())
        dims = self._trunk_dims()
        return list(dims) if dims else None

    def _trunk_dims(self) -> Dict[str, int]:
        dims = getattr(self.trunk, "feature_dims", None)
        return dict(dims()) if callable(dims) else {}

    def _default_layer(self) -> str:
        names = self._trunk_feature_names()
        return names[-1] if names else "trunk"

    def _check_heads(self) -> None:
        """Heads must match the trunk layers they read; fail now rather than at the first batch."""
        n_heads, n_layers = len(self.heads), len(self.feat_layer_names)
        if self.linear_eval_mode:
            if n_heads and n_heads != n_layers and not self.trunk_features_only:
                raise UserError(
                    f"{HEAD_KEY} has {n_heads} heads but MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP "
                    f"maps {n_layers} layers ({', '.join(self.feat_layer_names)}); linear evaluation needs one "
                    "head per mapped layer"
                )
            pairs = list(zip(range(n_heads), self.feat_layer_names, self.feat_pool_ops))
            if self.trunk_features_only:
                pairs = []  # the heads are not run in this mode
        else:
            pairs = [(0, self._default_layer(), None)] if n_heads else []
            self._check_head_chain()
        dims = self._trunk_dims()
        vector_fn = getattr(self.trunk, "vector_layers", None)
        vectors = set(vector_fn()) if callable(vector_fn) else set()
        trunk_name = (self.model_config.get("TRUNK", {}) or {}).get("NAME", "resnet")
        for idx, layer, op in pairs:
            head = _first_module(self.heads[idx])
            in_dim = getattr(head, "input_dim", None)
            if in_dim is None or layer not in dims:
                continue
            channels = dims[layer]
            positions = 1 if op is None and layer in vectors else None
            if op is not None:
                positions = pooled_positions(op, layer in vectors)
                if positions == 0:
                    raise UserError(
                        f"{POOL_OPS_KEY}[{idx}]: {op} gives trunk layer {layer!r} an output that holds no value; give "
                        f"the op an output size of at least 1"
                    )
            where = f"{HEAD_KEY}[{idx}] ({self.head_names[idx]})"
            if getattr(head, "input_is_channels", False):
                if in_dim != channels:
                    raise UserError(
                        f"{where} has in_channels={in_dim} but trunk {trunk_name!r} layer {layer!r} has "
                        f"{channels} channels; set in_channels to {channels}"
                    )
                flat = getattr(head, "dims", [None])[0]
                if positions is not None and flat is not None and flat != channels * positions:
                    raise UserError(
                        f"{where} has dims[0]={flat} but trunk {trunk_name!r} layer {layer!r} pooled gives "
                        f"{channels} x {positions} = {channels * positions} features; set dims[0] to "
                        f"{channels * positions}"
                    )
            elif positions is not None and in_dim != channels * positions:
                expected = channels * positions
                raise UserError(
                    f"{where} has input dim dims[0]={in_dim} but trunk {trunk_name!r} layer {layer!r} gives "
                    f"{expected} features; set dims[0] to {expected}"
                )

    def output_heads(self) -> List[Tuple[str, Optional[int]]]:
        """(config key, output size or None when unknown) of the head stage behind each output of
        :meth:`forward`, in order; empty when forward returns trunk features.

        Lets a class label be checked against the head that scores it, before launch (the
        dataset's labels) and when a step fails (the batch's labels), naming the key to change.
        """
        if self.trunk_features_only or len(self.heads) == 0:
            return []
        indices = range(len(self.heads)) if self.linear_eval_mode else [len(self.heads) - 1]
        return [self._last_stage(i) for i in indices]

    def output_sizes(self) -> Optional[List[Optional[int]]]:
        """One entry per output of :meth:`forward`: its number of classes (dim 1 of an [N, C] head
        output) as the config gives it, or None where the config does not say (a head without
        ``dims``, trunk features); None when not even the number of outputs is known (a user
        trunk's features). What a meter's ``check_outputs`` is given before launch."""
        if not self.trunk_features_only and len(self.heads):
            return [size for _, size in self.output_heads()]
        if self.linear_eval_mode:
            return [None] * len(self.feat_layer_names)
        from ssl_engine.models.trunks import FeatureTrunk

        return [None] if isinstance(self.trunk, FeatureTrunk) else None  # its default (last) layer only

    def _last_stage(self, i: int) -> Tuple[str, Optional[int]]:
        """(key, output size) of the last stage of head ``i`` (a list entry of HEAD.PARAMS is a chain)."""
        head, where, name = self.heads[i], f"{HEAD_KEY}[{i}]", self.head_names[i]
        if isinstance(head, nn.Sequential) and len(head) > 0:
            if len(head) > 1:
                where += f"[{len(head) - 1}]"
            head, name = head[-1], name.split("->")[-1]
        dims = getattr(head, "dims", None)
        if isinstance(dims, (list, tuple)) and dims and isinstance(dims[-1], int):
            return f"{where} ({name})", int(dims[-1])
        if isinstance(head, nn.Linear):
            return f"{where} ({name})", head.out_features
        return f"{where} ({name})", None

    def _check_head_chain(self) -> None:
        """In training mode heads run one after the other: each must read what the previous one gives."""
        stages: List[Tuple[str, nn.Module]] = []
        for i, head in enumerate(self.heads):
            parts = list(head) if isinstance(head, nn.Sequential) else [head]
            stages.extend((f"{HEAD_KEY}[{i}]" + (f"[{j}]" if len(parts) > 1 else ""), m) for j, m in enumerate(parts))
        for (prev_where, prev), (where, nxt) in zip(stages, stages[1:]):
            prev_dims = getattr(prev, "dims", None)
            in_dim = getattr(nxt, "input_dim", None)
            if not prev_dims or in_dim is None:
                continue
            if in_dim != prev_dims[-1]:
                raise UserError(
                    f"{where} has input dim {in_dim} but the head before it ({prev_where}) outputs "
                    f"{prev_dims[-1]}; chained heads must match"
                )

    def _freeze(self) -> None:
        if self.trunk_frozen:
            for p in self.trunk.parameters():
                p.requires_grad = False
        if self.heads_frozen:
            for p in self.heads.parameters():
                p.requires_grad = False
        for i, name in enumerate(self.model_config.get("NON_TRAINABLE_PARAMS") or []):
            # VISSL's list of parameter names the optimizer leaves alone; a module name covers its parameters
            params = match_params(self, str(name))
            if not params:
                raise no_such_params(f"config.MODEL.NON_TRAINABLE_PARAMS[{i}]", str(name), self)
            for _, p in params:
                p.requires_grad = False
        self.train(self.training)

    def train(self, mode: bool = True) -> "SSLModel":
        """Like nn.Module.train, but a frozen trunk (and frozen heads) stay in eval mode: BN stats don't move."""
        super().train(mode)
        if self.trunk_frozen:
            self.trunk.train(False)
        if self.heads_frozen:
            self.heads.train(False)
        return self

    # ----------------------------------------------------------------- forward
    def _frozen_trunk_no_grad(self) -> Any:
        """no_grad for a frozen trunk run while gradients are on; otherwise a null context (a
        grad-mode switch on every forward costs more than this check)."""
        return torch.no_grad() if self.trunk_frozen and torch.is_grad_enabled() else contextlib.nullcontext()

    def _trunk_forward(self, batch: Batch, layers: Optional[List[str]]) -> List[torch.Tensor]:
        """Trunk outputs for ``layers``; a list of crops is grouped by resolution and concatenated.

        Multi-crop batches (e.g. SwAV's 2x224 + 6x96) run one trunk pass per run of equally sized
        crops, and the features are concatenated along the batch dim, as VISSL does.
        """
        if isinstance(batch, torch.Tensor):  # one crop (the usual supervised batch): nothing to group
            return list(self._run_trunk(batch, layers))
        crops = list(batch)
        if not crops or not all(isinstance(c, torch.Tensor) for c in crops):
            raise UserError(f"model input must be a tensor or a list of tensors, got {type(batch).__name__}")
        chunks, start = [], 0
        for i in range(1, len(crops) + 1):
            if i == len(crops) or crops[i].shape[1:] != crops[start].shape[1:]:
                chunks.append(crops[start] if i - start == 1 else torch.cat(crops[start:i]))
                start = i
        outs = [self._run_trunk(chunk, layers) for chunk in chunks]
        if len(outs) == 1:
            return list(outs[0])
        return [torch.cat(parts) for parts in zip(*outs)]

    def _run_trunk(self, x: torch.Tensor, layers: Optional[List[str]]) -> List[torch.Tensor]:
        """The trunk on one tensor, without grad when the trunk is frozen and gradients are on."""
        if self.trunk_frozen and torch.is_grad_enabled():
            with torch.no_grad():
                out = self.trunk(x, layers)
        else:
            out = self.trunk(x, layers)
        if not isinstance(out, (list, tuple)) or not out or not isinstance(out[0], torch.Tensor):
            raise bad_trunk_output(self.trunk, self.trunk_name, out)
        if layers and len(out) != len(layers):
            raise UserError(
                f"trunk {self.trunk_name!r} (config.MODEL.TRUNK.NAME) {part_origin(type(self.trunk))} returned "
                f"{len(out)} feature tensor{'s' if len(out) != 1 else ''} for the {len(layers)} layers asked for in "
                f"out_feat_keys ({', '.join(map(str, layers))}, from {POOL_OPS_KEY}); a trunk returns one tensor per "
                f"name in out_feat_keys, in that order"
            )
        return out

    def _pooled_features(self, batch: Batch, flatten: bool) -> List[torch.Tensor]:
        feats = self._trunk_forward(batch, list(self.feat_layer_names))
        with self._frozen_trunk_no_grad():
            try:
                pooled = [op(f) for op, f in zip(self.feat_pool_ops, feats)]
            except POOL_ERRORS:  # no cost until raised (python >= 3.11)
                self._explain_pool_error(batch, feats)
                raise
        for idx, (p, f) in enumerate(zip(pooled, feats)):
            if 0 in p.shape[1:]:  # e.g. AdaptiveAvgPool1d([0]): features of no value, which no file can hold
                raise UserError(
                    f"{POOL_OPS_KEY}[{idx}]: {self.feat_pool_ops[idx]} gives trunk layer {self.feat_layer_names[idx]!r} "
                    f"of {list(f.shape[1:])} an output of {list(p.shape[1:])}, which holds no value; give the op an "
                    f"output size of at least 1"
                )
        feats = pooled
        if flatten:
            feats = [f.reshape(f.shape[0], -1) for f in feats]
        return feats

    def _explain_pool_error(self, batch: Batch, feats: List[torch.Tensor]) -> None:
        """A pool op that does not fit its layer's map (VISSL's maps are sized for 224x224 crops:
        a 6x6 kernel on a res5 of 2x2 when the images are 64x64) becomes a UserError naming the
        map entry, the layer's size and the input's. Any other error is left for the caller to
        re-raise."""
        for idx, (layer, op, feat) in enumerate(zip(self.feat_layer_names, self.feat_pool_ops, feats)):
            try:
                with torch.no_grad():
                    op(feat[:1])
            except POOL_ERRORS as e:
                first = batch if isinstance(batch, torch.Tensor) else list(batch)[0]
                image = "x".join(str(d) for d in first.shape[2:]) if first.ndim > 2 else "?"
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise UserError(
                    f"{POOL_OPS_KEY}[{idx}]: {op} does not fit trunk layer "
                    f"{layer!r} of {list(feat.shape[1:])} (input images {image}): {reason}; use a pool op that fits "
                    f"that size (e.g. AdaptiveAvgPool2d with the output size you want), or larger images"
                ) from None

    def forward(self, batch: Batch) -> List[torch.Tensor]:
        """Model outputs as a list: one tensor in training (or the list a head returns, e.g. swav_head's
        ``[embedding, scores_0, ...]``), one per mapped layer in linear evaluation."""
        if self.linear_eval_mode:
            if self.trunk_features_only or len(self.heads) == 0:
                return self._pooled_features(batch, self._settings["SHOULD_FLATTEN_FEATS"])
            feats = self._pooled_features(batch, flatten=False)
            return [head(feat) for head, feat in zip(self.heads, feats)]
        feats = self._trunk_forward(batch, None)
        heads = self.heads
        if self.trunk_features_only or not heads:
            return feats
        out = feats[0]
        for head in heads:
            out = head(out)
        # a head with several outputs (swav_head: embedding, prototype scores) gives them as a list
        return list(out) if isinstance(out, (list, tuple)) else [out]

    @property
    def extracts_head_output(self) -> bool:
        """Whether :meth:`extract_features` writes the last head's output (``heads``)."""
        return not self.feat_layer_names and not self._settings["EXTRACT_TRUNK_FEATURES_ONLY"] and len(self.heads) > 0

    @torch.no_grad()
    def extract_features(self, batch: Batch) -> Dict[str, torch.Tensor]:
        """Features to save, keyed by layer name (no grad; the caller sets eval mode).

        Trunk layers after their pool op (flattened to [N, D] if SHOULD_FLATTEN_FEATS) when
        EXTRACT_TRUNK_FEATURES_ONLY or a LINEAR_EVAL_FEAT_POOL_OPS_MAP is set; otherwise
        ``{"heads": <last head's output>}``. With EXTRACT_TRUNK_FEATURES_ONLY and no map it is
        ``{<trunk's last layer>: ...}``; a model without heads gives its trunk's last layer as
        ``heads``, the name VISSL's extraction gives the model's output whatever it holds. A
        head with several outputs (swav_head: embedding, prototype scores) gives its first, the
        embedding, as VISSL's extraction does.
        """
        flatten = self._settings["SHOULD_FLATTEN_FEATS"]
        if self.feat_layer_names:
            feats = self._pooled_features(batch, flatten)
            return dict(zip(self.feat_output_names, feats))
        if not self.extracts_head_output:
            feat = self._trunk_forward(batch, None)[0]
            if flatten:
                feat = feat.reshape(feat.shape[0], -1)
            return {self._default_layer() if self._settings["EXTRACT_TRUNK_FEATURES_ONLY"] else "heads": feat}
        out = self._trunk_forward(batch, None)[0]
        for head in self.heads:
            out = head(out)
        if isinstance(out, (list, tuple)):
            out = out[0]
        return {"heads": out}

    # ----------------------------------------------------------------- state
    def get_classy_state(self, deep_copy: bool = False) -> Dict[str, Any]:
        """``{"model": {"trunk": ..., "heads": ...}}``, VISSL's layout of ``classy_state_dict.base_model``."""
        state = {"model": {"trunk": self.trunk.state_dict(), "heads": self.heads.state_dict()}}
        if deep_copy:
            state = {"model": {k: {n: t.clone() for n, t in v.items()} for k, v in state["model"].items()}}
        return state

    def set_classy_state(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Load what :meth:`get_classy_state` returned (heads may be partial unless ``strict``)."""
        self.trunk.load_state_dict(state["model"]["trunk"], strict=strict)
        self.heads.load_state_dict(state["model"]["heads"], strict=strict)


def build_model(model_config: AttrDict, optimizer_config: Optional[AttrDict] = None) -> SSLModel:
    """The SSLModel described by ``config.MODEL`` (``optimizer_config`` is kept for VISSL's signature)."""
    model = SSLModel(model_config, optimizer_config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "built model: trunk %s, heads [%s], %d params (%d trainable)",
        type(model.trunk).__name__,
        ", ".join(model.head_names),
        total,
        trainable,
    )
    return model


def sync_bn_group_size(group_size: int, world_size: int, num_proc_per_node: int) -> int:
    """How many ranks share one SyncBN group, as VISSL reads ``MODEL.SYNC_BN_CONFIG.GROUP_SIZE``:
    0 means all ranks, a negative value (the default -1) the ranks of one machine, a positive
    value that many ranks (at most the world size)."""
    if group_size == 0:
        return world_size
    if group_size < 0:
        return min(world_size, num_proc_per_node)
    return min(world_size, group_size)


def convert_sync_batchnorm(
    model: nn.Module, sync_bn_config: Optional[AttrDict], num_proc_per_node: Optional[int] = None
) -> nn.Module:
    """BatchNorms -> torch SyncBatchNorm when ``MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN``.

    ``GROUP_SIZE`` (VISSL's meaning, see :func:`sync_bn_group_size`): > 0 syncs within groups of
    that many ranks (built with ``torch.distributed.new_subgroups``, a collective every rank must
    reach); 0 syncs over all ranks; < 0 (the default, -1) syncs within one machine.
    Call it on every rank, before wrapping in DistributedDataParallel.
    """
    cfg = sync_bn_config or {}
    if not cfg.get("CONVERT_BN_TO_SYNC_BN", False):
        return model
    bn_type = str(cfg.get("SYNC_BN_TYPE", "pytorch")).lower()
    if bn_type not in ("pytorch", "apex"):
        raise UserError(f"config.MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE={bn_type!r} is not supported; valid: pytorch, apex")
    if bn_type == "apex":
        logger.warning("config.MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE=apex runs as torch.nn.SyncBatchNorm (apex is not used)")
    group_size = cfg.get("GROUP_SIZE", -1)
    try:
        group_size = int(group_size)
    except (TypeError, ValueError):
        raise UserError(f"config.MODEL.SYNC_BN_CONFIG.GROUP_SIZE={group_size!r} must be an integer") from None
    process_group = None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        group_size = sync_bn_group_size(
            group_size, world, int(num_proc_per_node or os.environ.get("LOCAL_WORLD_SIZE", world))
        )
        if 0 < group_size < world:
            if world % group_size:
                raise UserError(
                    f"config.MODEL.SYNC_BN_CONFIG.GROUP_SIZE={group_size} must divide the world size {world}"
                )
            process_group, _ = dist.new_subgroups(group_size=group_size)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
