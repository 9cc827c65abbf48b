"""One Registry class; every pluggable kind of the engine is an instance of it.

Users add their own parts with a decorator and name them in yaml::

    from ssl_engine.registry import TRUNKS

    @TRUNKS.register("my_trunk")
    class MyTrunk(nn.Module): ...
"""

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from ssl_engine.errors import UserError, did_you_mean


def accepted_params(cls: Any, skip: int = 0) -> List[str]:
    """The keyword parameters a registered class takes (its signature's names after the first
    ``skip``, without ``*args`` / ``**kwargs``), for the "it accepts: ..." part of an error."""
    import inspect

    try:
        params = list(inspect.signature(cls).parameters.values())[skip:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def part_origin(obj: Any) -> str:
    """'(file.py line N)': where a registered class or function is defined, for errors about a
    part of the user's; empty when that is unknown."""
    import inspect

    try:
        return f"({inspect.getsourcefile(obj)} line {inspect.getsourcelines(obj)[1]})"
    except (TypeError, OSError):
        return ""


def check_call(part: Any, args: Sequence[Any], name: str, what: str, call: str, hint: str) -> None:
    """A UserError when ``part`` (a class or function of the user's) cannot be called with
    ``args``, before it is: ``"{what} (file line N) cannot be {call}: {why}; {hint}"``, where
    ``call`` holds ``{}`` for the part's name (``name`` when it has none). A part without a
    signature to read is left to the call itself."""
    import inspect

    try:
        inspect.signature(part).bind(*args)
    except TypeError as e:
        raise UserError(
            f"{what} {part_origin(part)} cannot be {call.format(getattr(part, '__name__', name))}: {e}; {hint}"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call says what is wrong
        pass


def build_from_config(kind: str, name: str, key: str, cls: Any, options: Mapping[str, Any]) -> Any:
    """``cls.from_config(options)``; a TypeError raised where the call's arguments are bound (a
    constructor that does not take the options: an unknown or a missing keyword) is a UserError
    naming the part, the key of its options and the options. An error raised further inside the
    constructor's own code is left as it is."""
    import types

    try:
        return cls.from_config(options)
    except TypeError as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        from_config = getattr(getattr(cls, "from_config", None), "__func__", None)
        binding = {build_from_config.__code__}
        if isinstance(from_config, types.FunctionType):
            binding.add(from_config.__code__)
        if tb is None or tb.tb_frame.f_code not in binding:
            raise
        raise UserError(
            f"{kind} {name!r} ({key}) {part_origin(cls)} cannot be built from its options "
            f"{dict(options)!r}: {e}; accepted: {', '.join(accepted_params(cls)) or '(none)'}"
        ) from None


def load_builtin_parts() -> None:
    """Import every module that registers a built-in part (imports torch; once per process)."""
    import ssl_engine.data  # noqa: F401
    import ssl_engine.engines.extract_features  # noqa: F401
    import ssl_engine.engines.train  # noqa: F401
    import ssl_engine.hooks  # noqa: F401
    import ssl_engine.losses  # noqa: F401
    import ssl_engine.meters  # noqa: F401
    import ssl_engine.models  # noqa: F401
    import ssl_engine.optim  # noqa: F401
    import ssl_engine.tasks  # noqa: F401
    import ssl_engine.train_steps  # noqa: F401


class RegistrationError(UserError, ValueError):
    """A name registered twice in one registry (a part of the user's named like a built-in)."""


class Registry:
    """A name -> object table for one kind of part (trunk, loss, hook, ...).

    ``vissl_names``: names VISSL registers for this kind (0.1.6, and its later main branch,
    whose configs users run too: DINO on ConvNeXt / Swin, NNCLR, iBOT, MSN) that the engine does
    not implement. A VISSL config naming one is told so (and how to register one's own under that
    name), not offered the nearest implemented name, which would train something else.
    ``fsdp_variants``: VISSL's FSDP (fully sharded) variants of its parts, each mapped to the part
    it shards: the engine trains with DDP, so a config naming one is told to name the other.
    """

    def __init__(self, kind: str, config_key: str = "", symbol: str = "", vissl_names: Iterable[str] = (),
                 fsdp_variants: Optional[Mapping[str, str]] = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self.symbol = symbol
        self.vissl_names = frozenset(vissl_names)
        self.fsdp_variants = dict(fsdp_variants or {})
        self._objects: Dict[str, Any] = {}

    def register(self, name: Optional[str] = None) -> Callable[[Any], Any]:
        """Decorator that registers a class or function under ``name`` (default: its __name__)."""

        def wrap(obj: Any) -> Any:
            key = name or obj.__name__
            if key in self._objects and self._objects[key] is not obj:
                other = self._objects[key]
                raise RegistrationError(
                    f"{self.kind} {key!r} is already registered to {getattr(other, '__module__', '?')}."
                    f"{getattr(other, '__qualname__', repr(other))}; register yours under another name")
            self._objects[key] = obj
            return obj

        return wrap

    def get(self, name: str, key: Optional[str] = None) -> Any:
        """The object registered as ``name``; an unknown name is a UserError listing the known ones
        and naming the config key (``key`` when the caller knows the exact one, e.g. with the split).

        A miss first imports the built-in parts: code that builds a task or trainer itself (not
        through the tool, which imports them at start) must find 'standard_train_step' too."""
        if name not in self._objects:
            load_builtin_parts()
        if name not in self._objects:
            key = key or self.config_key
            where = f" (config key{'s' if ', ' in key else ''} {key})" if key else ""
            base = self.fsdp_variants.get(name)
            if base is not None:
                fix = (f": name {base!r} instead, which takes the same settings" if base in self._objects else
                       f", and {base!r} is one of VISSL's that ssl_engine does not implement; implemented: "
                       f"{', '.join(sorted(self._objects)) or '(none)'}")
                raise UserError(
                    f"{self.kind} {name!r}{where} is VISSL's FSDP (fully sharded data parallel) variant of {base!r}; "
                    f"ssl_engine shards no model (it trains with DistributedDataParallel){fix}"
                )
            if name in self.vissl_names:
                raise UserError(
                    f"{self.kind} {name!r}{where} is one of VISSL's that ssl_engine does not implement; "
                    f"implemented: {', '.join(sorted(self._objects)) or '(none)'}; to use your own, register it "
                    f"with @{self.symbol}.register({name!r}) in a file listed in config.USER_MODULES"
                )
            raise UserError(
                f"unknown {self.kind} {name!r}{where}{did_you_mean(str(name), self._objects)}; "
                f"known: {', '.join(sorted(self._objects)) or '(none)'}"
            )
        return self._objects[name]

    def names(self) -> List[str]:
        return sorted(self._objects)

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


TASKS = Registry("task", "config.TRAINER.TASK_NAME",
                 fsdp_variants={"self_supervision_fsdp_task": "self_supervision_task"})
TRAIN_STEPS = Registry("train step", "config.TRAINER.TRAIN_STEP_NAME")
ENGINES = Registry("engine", "engine_name", "ENGINES", vissl_names=("extract_cluster", "extract_label_predictions"))
HOOKS = Registry("hook", "config.HOOKS.CUSTOM[].name")
TRUNKS = Registry("trunk", "config.MODEL.TRUNK.NAME", "TRUNKS", vissl_names=(
    "alexnet_bvlc", "alexnet_colorization", "alexnet_deepcluster", "alexnet_jigsaw", "alexnet_rotnet", "convit",
    "efficientnet", "vision_transformer", "xcit", "beit", "classy_vit", "convnext", "mobilenetv3_tv", "regnet_v2",
    "swin_transformer"), fsdp_variants={"regnet_fsdp": "regnet"})
HEADS = Registry("head", "config.MODEL.HEAD.PARAMS", "HEADS", vissl_names=(
    "dino_head", "identity", "siamese_concat_view", "eval_mlp_pooled", "ibot_distillation_head", "ibot_head", "mlp_res",
    "mobilenet_v3_head", "msn_head", "vision_transformer_head"),
                 fsdp_variants={"mlp_fsdp": "mlp", "eval_mlp_fsdp": "eval_mlp", "swav_head_fsdp": "swav_head",
                                "dino_head_fsdp": "dino_head"})
LOSSES = Registry("loss", "config.LOSS.name", "LOSSES", vissl_names=(
    "bce_logits_multiple_output_single_target", "byol_loss", "deepclusterv2_loss", "dino_loss", "nce_loss_with_memory",
    "swav_momentum_loss", "dino_distillation_loss", "ibot_distillation_loss", "ibot_loss", "msn_distillation_loss",
    "msn_loss", "nnclr_info_nce_loss", "soft_target_cross_entropy_multiple_output_single_target",
    "swav_distillation_loss"))
METERS = Registry("meter", "config.METERS.names", "METERS", vissl_names=("mean_ap_list_meter",))
OPTIMIZERS = Registry("optimizer", "config.OPTIMIZER.name")
DATA_SOURCES = Registry("data source", "config.DATA.<split>.DATA_SOURCES", "DATA_SOURCES",
                        vissl_names=("everstore",))  # Facebook's internal image store, named by some VISSL configs
TRANSFORMS = Registry("transform", "config.DATA.<split>.TRANSFORMS[].name", "TRANSFORMS", vissl_names=(
    "ImgPatchesFromTensor", "ImgPil2LabTensor", "ImgPilGaussianBlurCV2", "ImgPilRandomColorJitter",
    "ImgPilRandomPhotometric", "ImgPilResizeLargerSide", "ImgPilSolarize", "ImgPilToPatchesAndImage",
    "ImgPilToRawTensor", "ImgToTensor", "MNISTImgPil2RGB", "OneHotEncode", "ShuffleImgPatches",
    "VisslAutoAugment", "ImgPil2RGB", "MaskedImageModeling", "MultiLabelTransform", "TensorToImgPil"))
COLLATORS = Registry("collator", "config.DATA.<split>.COLLATE_FUNCTION", "COLLATORS", vissl_names=(
    "cutmixup_collator", "patch_and_image_collator", "siamese_collator", "targets_one_hot_default_collator",
    "ibot_multicrop_masking_collator", "identity_collator", "multicrop_mixup_collator"))
