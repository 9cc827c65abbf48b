"""Config: defaults.yaml, hydra composition, validation, AttrDict."""

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.compose import compose, load_defaults, to_yaml

__all__ = ["AttrDict", "compose", "load_defaults", "to_yaml"]
