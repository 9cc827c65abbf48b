"""Compose a run's config from defaults.yaml, an experiment file and command-line overrides.

Uses hydra's compose API: ``config=quick/simclr_digits`` selects
``configs/config/quick/simclr_digits.yaml``; ``config=/any/path/file.yaml`` selects a file
anywhere; ``config.A.B=v`` overrides a key and ``+config.A.NEW=v`` adds one. The result is
validated (see validate.py) and returned as an AttrDict of the ``config:`` node with
``engine_name`` added to it.
"""

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.validate import flatten_keys, validate
from ssl_engine.errors import ConfigError, closest

log = logging.getLogger(__name__)

DEFAULTS_DIR = Path(__file__).resolve().parent
DEFAULTS_FILE = DEFAULTS_DIR / "defaults.yaml"


def config_search_dirs() -> List[Path]:
    """Folders whose ``config/`` sub-folder holds experiment yamls, first match wins.

    $SSL_ENGINE_CONFIG_DIR, then ./configs, then the configs/ folder beside the package.
    """
    dirs = []
    env = os.environ.get("SSL_ENGINE_CONFIG_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(Path.cwd() / "configs")
    dirs.append(DEFAULTS_DIR.parent.parent / "configs")
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen and (r / "config").is_dir():
            seen.add(r)
            out.append(r)
    return out


def known_experiments() -> List[str]:
    """Every experiment name that ``config=`` accepts, e.g. quick/simclr_digits."""
    names = set()
    for d in config_search_dirs():
        for p in (d / "config").rglob("*.yaml"):
            names.add(str(p.relative_to(d / "config").with_suffix("")))
    return sorted(names)


def load_defaults() -> dict:
    """defaults.yaml as a plain dict (root: engine_name + config)."""
    data = OmegaConf.to_container(OmegaConf.load(DEFAULTS_FILE), resolve=True)
    data.pop("defaults", None)
    return data


def _split_override(item: str) -> Tuple[str, str]:
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key=value (e.g. config.OPTIMIZER.num_epochs=2)"
        )
    key, value = item.split("=", 1)
    key = key.strip()
    if not key or not re.fullmatch(r"[+~]{0,2}[A-Za-z_][\w.\-\[\]]*", key):
        raise ConfigError(f"override {item!r} has an invalid key {key!r}")
    return key, value


def _check_yaml_file(path: Path) -> None:
    """Safe-load a yaml file so that malformed yaml is reported with file and line."""
    try:
        with open(path) as f:
            yaml.safe_load(f)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"malformed yaml in {where}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed yaml in {path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def _resolve_experiment(value: str, tmp: Path) -> Tuple[str, List[Path]]:
    """Map the value of ``config=`` to (group option, extra search dirs)."""
    value = value.strip()
    as_path = Path(value).expanduser()
    if value.endswith((".yaml", ".yml")) and (as_path.is_file() or as_path.is_absolute()):
        if not as_path.is_file():
            raise ConfigError(f"config={value}: no such file")
        _check_yaml_file(as_path)
        # Present the user's file to hydra as an option of the `config` group.
        (tmp / "config").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(as_path, tmp / "config" / "user_file.yaml")
        return "user_file", [tmp]
    name = value[:-5] if value.endswith(".yaml") else value
    for d in config_search_dirs():
        f = d / "config" / f"{name}.yaml"
        if f.is_file():
            _check_yaml_file(f)
            return name, []
    near = closest(name, known_experiments(), n=3)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    dirs = ", ".join(str(d / "config") for d in config_search_dirs()) or "(no configs/config folder found)"
    raise ConfigError(f"config={value} matches no file under {dirs}{hint}")


def _hydra_compose(overrides: List[str], search_dirs: Iterable[Path]) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    paths = ",".join(f"file://{d}" for d in search_dirs)
    all_overrides = [f"hydra.searchpath=[{paths}]"] + overrides
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(DEFAULTS_DIR), version_base=None):
            cfg = hydra_compose(config_name="defaults", overrides=all_overrides)
            return OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(_explain_hydra_error(e)) from None
    finally:
        GlobalHydra.instance().clear()


def _explain_hydra_error(e: Exception) -> str:
    msg = " ".join(str(e).split())
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(r"Key '([^']+)' is not in struct", msg)
    if m:
        key = m.group(1)
        known = flatten_keys(load_defaults())
        near = closest(key, known, n=3)
        hint = f"; closest: {', '.join(near)}" if near else ""
        return f"unknown config key {key}{hint} (use +{key}=... to add a new key)"
    return f"cannot compose the config: {msg}"


def compose(overrides: Optional[List[str]] = None, warn_unused: bool = True) -> AttrDict:
    """Compose, validate and return the config (the ``config:`` node plus ``engine_name``).

    Raises ConfigError (a UserError) with one clear line for anything the user can fix.
    """
    overrides = list(overrides or [])
    hydra_overrides: List[str] = []
    added_keys: List[str] = []
    experiment: Optional[str] = None
    with tempfile.TemporaryDirectory(prefix="ssl_engine_cfg_") as tmpdir:
        extra_dirs: List[Path] = []
        for item in overrides:
            key, value = _split_override(item)
            if key == "config":
                experiment = value
                continue
            if key.startswith("+") and not key.startswith("++"):
                added_keys.append(key[1:])
            hydra_overrides.append(f"{key}={value}")
        if experiment is not None:
            option, extra_dirs = _resolve_experiment(experiment, Path(tmpdir))
            hydra_overrides.insert(0, f"config={option}")
        root = _hydra_compose(hydra_overrides, extra_dirs + config_search_dirs())
    root.pop("hydra", None)
    if not isinstance(root.get("config"), dict):
        raise ConfigError("the composed config has no 'config:' node; experiment files put options under 'config:'")
    cfg = validate(root, load_defaults(), added_keys=added_keys, warn_unused=warn_unused)
    return cfg


def to_yaml(cfg: AttrDict) -> str:
    """The resolved config as a yaml document that ``config=/path/file.yaml`` can read back."""
    data = cfg.to_dict() if isinstance(cfg, AttrDict) else dict(cfg)
    engine = data.pop("engine_name", "train")
    body = yaml.safe_dump({"engine_name": engine, "config": data}, sort_keys=False)
    return "# @package _global_\n" + body
