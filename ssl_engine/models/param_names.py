"""Parameters named in the config: a parameter's full name or a module prefix.

``MODEL.NON_TRAINABLE_PARAMS`` and ``MODEL.TEMP_FROZEN_PARAMS_ITER_MAP`` name parameters as
``model.named_parameters()`` gives them (``trunk._feature_blocks.conv1.weight``,
``heads.0.clf.0.weight``), or a module (``heads.0``) for every parameter under it. VISSL's
configs may name them as seen through DistributedDataParallel (``module.heads.0...``) or through
FairScale's FSDP wrappers (``_fsdp_wrapped_module.heads.0._fsdp_wrapped_module._fpw_module.
prototypes0...``): those wrappers' segments are left out, which gives the same parameter.
"""

from typing import List, Tuple

import torch

from ssl_engine.errors import UserError, did_you_mean


WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_fpw_module.")  # FairScale FSDP / FlattenParamsWrapper


def match_params(model: torch.nn.Module, name: str) -> List[Tuple[str, torch.nn.Parameter]]:
    """The parameters called ``name`` or under the module ``name``; a ``module.`` prefix and the
    segments of FSDP wrappers are dropped when the name does not match as written."""
    prefix = name.rstrip(".") + "."
    found = [(n, p) for n, p in model.named_parameters() if n == name or n.startswith(prefix)]
    if found:
        return found
    plain = name
    for segment in WRAPPER_SEGMENTS:
        plain = plain.replace(segment, "")
    if plain.startswith("module."):
        plain = plain[len("module."):]
    return match_params(model, plain) if plain != name else []


def no_such_params(key: str, name: str, model: torch.nn.Module) -> UserError:
    """The error for a name that matches nothing: the closest names and what names look like."""
    names = [n for n, _ in model.named_parameters()]
    candidates = names + [n for n, _ in model.named_modules() if n]
    return UserError(f"{key}: {name!r} names no parameter or module of the model{did_you_mean(name, candidates)}; "
                     f"parameter names look like {names[0] if names else '(none)'!r}, modules like 'trunk' or 'heads.0'")
