"""Engines: what one process of a run does (train, extract_features), found by engine_name."""

from ssl_engine.engines.run import run_engine
from ssl_engine.registry import ENGINES

__all__ = ["ENGINES", "run_engine"]
