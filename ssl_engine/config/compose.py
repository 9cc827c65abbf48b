"""Compose a run's config from defaults.yaml, an experiment file and command-line overrides.

Uses hydra's compose API: ``config=quick/simclr_digits`` selects
``configs/config/quick/simclr_digits.yaml``; ``config=/any/path/file.yaml`` selects a file
anywhere; ``config.A.B=v`` overrides a key and ``+config.A.NEW=v`` adds one. The result is
validated (see validate.py) and returned as an AttrDict of the ``config:`` node with
``engine_name`` added to it.
"""

import copy
import functools
import json
import logging
import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import yaml
from omegaconf import OmegaConf

from ssl_engine.config.attr_dict import AttrDict
from ssl_engine.config.forked_compose import remove_stale_scratch_folders, scratch_folder_prefix
from ssl_engine.config.validate import (
    _compat_ancestor,
    flatten_keys,
    is_older_layout_key,
    keys_set_at_new_places,
    keys_beyond_defaults,
    nearest_keys,
    unknown_key_message,
    validate,
)
from ssl_engine.errors import ConfigError, closest, expand_user

log = logging.getLogger(__name__)

DEFAULTS_DIR = Path(__file__).resolve().parent
DEFAULTS_FILE = DEFAULTS_DIR / "defaults.yaml"


def config_search_dirs(tree: Optional[Path] = None) -> List[Path]:
    """Folders whose ``config/`` sub-folder holds experiment yamls, first match wins.

    $SSL_ENGINE_CONFIG_DIR, then ``tree`` (the config tree a ``config=`` file lies in, see
    :func:`own_config_tree`), then ./configs, then the configs/ folder beside the package.
    """
    dirs = []
    env = os.environ.get("SSL_ENGINE_CONFIG_DIR")
    if env:
        dirs.append(Path(env))
    if tree is not None:
        dirs.append(tree)
    dirs.append(Path.cwd() / "configs")
    dirs.append(DEFAULTS_DIR.parent.parent / "configs")
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen and (r / "config").is_dir():
            seen.add(r)
            out.append(r)
    return out


def own_config_tree(experiment: Optional[str]) -> Optional[Path]:
    """For ``config=`` naming a yaml file by its path inside a ``config/`` folder (a VISSL user's
    ``configs/config/pretrain/swav/swav_8node_resnet.yaml``): the folder holding that ``config/``,
    so that the file's ``+config/<group>=<name>`` overlays and ``defaults:`` are found beside it."""
    if not experiment or not experiment.strip().endswith((".yaml", ".yml")):
        return None
    path = expand_user(experiment.strip(), "config")
    if not path.is_file():
        return None
    for parent in path.resolve().parents:
        if parent.name == "config":
            return parent.parent
    return None


def _written_as_path(text: str) -> bool:
    """``config=`` written as a path of the file system, not as a name in the config search path."""
    return text.startswith(("/", "~", "./", "../")) or text in (".", "..")


def with_yaml_ending(value: str) -> str:
    """``config=`` given as a path to a yaml file without its ending (``config=/data/exp/simclr``,
    as VISSL names experiments without ``.yaml``): the path with ``.yaml`` (or ``.yml``) added
    where that file exists. Only for a value written as a path (absolute, ``~``, ``./``, ``../``),
    which no experiment name of the config search path can be; anything else is returned as is."""
    text = value.strip()
    if text.endswith((".yaml", ".yml", "/")) or not _written_as_path(text):
        return value
    try:
        path = expand_user(text, "config")
    except ConfigError:
        return value  # said where the value is read as a path
    for ending in (".yaml", ".yml"):
        if Path(f"{path}{ending}").is_file() and not path.is_file() and not path.is_dir():
            return f"{text}{ending}"
    return value


def known_experiments() -> List[str]:
    """Every experiment name that ``config=`` accepts, e.g. quick/simclr_digits."""
    names = set()
    for d in config_search_dirs():
        for p in (d / "config").rglob("*.yaml"):
            names.add(str(p.relative_to(d / "config").with_suffix("")))
    return sorted(names)


def load_defaults() -> dict:
    """defaults.yaml as a plain dict (root: engine_name + config); a fresh copy on every call."""
    return copy.deepcopy(_defaults_cached(DEFAULTS_FILE.stat().st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _defaults_cached(mtime_ns: int) -> dict:
    data = read_defaults_file(DEFAULTS_FILE)
    data.pop("defaults", None)
    return data


# The float rule of OmegaConf's yaml loader: unlike YAML 1.1, ``1e-5`` (no dot) is a float.
_OMEGACONF_FLOAT = re.compile(
    r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


@functools.lru_cache(maxsize=1)
def _omegaconf_like_loader() -> Optional[type]:
    """A libyaml (C) loader that reads values as ``OmegaConf.load`` does: its float rule, no
    timestamps, duplicate keys refused. None when PyYAML was built without libyaml."""
    base = getattr(yaml, "CSafeLoader", None)
    if base is None:
        return None

    class _Loader(base):  # type: ignore[misc,valid-type]
        pass

    _Loader.add_implicit_resolver("tag:yaml.org,2002:float", _OMEGACONF_FLOAT, list("-+0123456789."))
    _Loader.yaml_implicit_resolvers = {
        key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for key, resolvers in _Loader.yaml_implicit_resolvers.items()
    }
    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
    return _Loader


def read_defaults_file(path: Path) -> dict:
    """A yaml file of the package (defaults.yaml) as the plain dict ``OmegaConf.load`` +
    ``to_container(resolve=True)`` would give, read with libyaml: ~15x faster than OmegaConf's
    pure-python loader, which matters at every start. Files with ``${...}`` interpolations, or
    a PyYAML without libyaml, go through OmegaConf."""
    text = path.read_text(encoding="utf-8")
    loader = _omegaconf_like_loader()
    if loader is None or "${" in text:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    data = yaml.load(text, Loader=loader)  # noqa: S506 - a CSafeLoader subclass
    return {} if data is None else data


def _split_override(item: str) -> Tuple[str, str]:
    if item.startswith("~") and "=" not in item:
        if not item.startswith("~config."):
            raise ConfigError(
                f"override {item!r} would delete {item[1:] or 'nothing'}; ~ deletes one key of the config, "
                f"e.g. ~config.METERS.accuracy_list"
            )
        return item, ""  # hydra's deletion: ~config.A.B removes the key (a yaml file's, or a default)
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key=value (e.g. config.OPTIMIZER.num_epochs=2)"
        )
    key, value = item.split("=", 1)
    key = key.strip()
    if re.fullmatch(r"\+config(/[\w.\-]+)+", key):
        return key, value  # VISSL's overlay of a config group file: +config/<group path>=<file>
    if re.fullmatch(r"config(/[\w.\-]+)+", key):
        raise ConfigError(
            f"override {item!r} names a config group file without its '+': write +{item} (as VISSL's "
            f"commands do) to merge {key}/{value.strip()}.yaml over the experiment"
        )
    if not key or not re.fullmatch(r"[+~]{0,2}[A-Za-z_][\w.\-\[\]]*", key):
        raise ConfigError(
            f"override {item!r} has an invalid key {key!r}: use config.SECTION.KEY=value (or +config.NEW_KEY=value)"
        )
    return key, value


@functools.lru_cache(maxsize=1)
def _overrides_parser() -> Any:
    """hydra's override parser; creating one costs more than parsing a few overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def hydra_quoted(text: str) -> str:
    """``text`` as a double-quoted string of hydra's override grammar, which reads it back as
    ``text``: a quote, and the backslashes before one, are escaped with a backslash."""
    escaped = re.sub(r'(\\*)"', lambda m: m.group(1) * 2 + '\\"', text)
    return '"' + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped) + '"'


def _check_override_grammar(item: str) -> None:
    """Parse one override with hydra's grammar, so that a bad one is named in the error, and
    refuse a sweep (``key=1,2``, ``key=choice(...)``, ``range``, ``interval``, ``glob``)."""
    try:
        override = _overrides_parser().parse_override(item)
    except Exception as e:  # hydra raises HydraException; anything else is as much the override's fault
        why = " ".join(str(e).split()) or type(e).__name__
        key, _, value = item.partition("=")
        if not _parses(f"{key}=0"):  # the key is at fault, whatever the value holds
            _refuse_key(item, key, why)
        quoted_key = re.search(r"""[{,]\s*(["'])([^"']*)\1\s*:""", value)
        if quoted_key:  # hydra's grammar takes mapping keys unquoted only
            raise ConfigError(
                f"override {item!r} cannot be parsed: hydra takes the keys of a mapping unquoted "
                f"({{{quoted_key.group(2)}: ...}}, not {{{quoted_key.group(1)}{quoted_key.group(2)}{quoted_key.group(1)}: ...}}), "
                f"e.g. 'config.MODEL.HEAD.PARAMS=[[mlp,{{dims:[512,10]}}]]'"
            ) from None
        if value.startswith("~"):  # hydra's grammar reads ~ only as the delete prefix of a key
            raise ConfigError(
                f"override {item!r} cannot be parsed: hydra does not take a value that starts with ~ unquoted; "
                f"quote it for hydra inside the shell word ('{key}=\"{value}\"') or write $HOME instead of ~"
            ) from None
        if value.count("${") > 1 and not value.lstrip().startswith(("[", "{", '"', "'")):
            # hydra's grammar reads an unquoted interpolation up to its first '}': one nested in
            # another (${oc.decode:${oc.env:NAME}}) must be quoted; quoted, it is still resolved
            raise ConfigError(
                f"override {item!r} cannot be parsed: hydra takes an interpolation nested in another only "
                f"quoted; quote it for hydra inside the shell word: {shlex.quote(f'{key}={hydra_quoted(value)}')}"
            ) from None
        odd = next((c for c in value if not c.isascii()), None)
        if odd is not None and not value.lstrip().startswith(("{", '"', "'")):
            # hydra's grammar takes a bare value (or list element) of ASCII characters only: a path
            # with an accented letter must be quoted for hydra inside the shell word
            if value.lstrip().startswith("[") and value.rstrip().endswith("]"):
                example = "[" + ",".join(v.strip() if v.strip().startswith(('"', "'")) else hydra_quoted(v.strip())
                                         for v in value.strip()[1:-1].split(",")) + "]"
                how = f"quote each element for hydra inside the shell word: {shlex.quote(f'{key}={example}')}"
            else:
                how = f"quote it for hydra inside the shell word: {shlex.quote(f'{key}={hydra_quoted(value)}')}"
            raise ConfigError(
                f"override {item!r} cannot be parsed: hydra takes a value holding {odd!r} only quoted; {how}"
            ) from None
        quoted = f"{key}={hydra_quoted(value)}"
        if not value.lstrip().startswith(("[", "{", '"', "'")) and "${" not in value and _parses(quoted):
            # a plain value (a path) holding a character hydra's grammar reserves: = ( ) [ ] { } ...
            raise ConfigError(
                f"override {item!r} cannot be parsed ({why}): hydra takes a value holding one of its grammar's "
                f"characters (= ( ) [ ] {{ }} , ' \" ...) only quoted; quote it for hydra inside the shell word: "
                f"{shlex.quote(quoted)}"
            ) from None
        raise ConfigError(
            f"override {item!r} cannot be parsed ({why}); quote lists and mappings as one shell word, "
            f"e.g. 'config.MODEL.HEAD.PARAMS=[[mlp,{{dims:[512,10]}}]]'"
        ) from None
    if override.is_sweep_override():
        _refuse_sweep(item, override)


def _refuse_key(item: str, key: str, why: str) -> None:
    """An override whose key hydra's grammar cannot read: an index in brackets (``TRANSFORMS[1].size``,
    as omegaconf's select writes it) is named as the key it means; any other key gets the form keys take."""
    dotted = re.sub(r"\[(\d+)\]", r".\1", key)
    if dotted != key and _parses(f"{dotted}=0"):
        raise ConfigError(f"override {item!r}: hydra names an entry of a list by its index as a part of the key, "
                          f"without brackets: {dotted}={item.partition('=')[2]}")
    raise ConfigError(f"override {item!r} has an invalid key {key!r} ({why}): keys are names joined by dots, "
                      f"config.SECTION.KEY=value (+ to add a key, ~ to delete one)")


def _parses(item: str) -> bool:
    """Whether hydra's grammar reads the override ``item``."""
    try:
        _overrides_parser().parse_override(item)
    except Exception:  # HydraException, or anything else the grammar raises
        return False
    return True


def _refuse_sweep(item: str, override: Any) -> None:
    """A sweep over values is hydra's multirun, which the tool does not run (it composes one
    config with hydra's compose API, not @hydra.main); hydra's own line advised adding
    --multirun, which the tool refuses. ``key=1,2`` is named as what it likely meant instead:
    a list, or a string holding a comma."""
    key, _, value = item.partition("=")
    once = "the tool runs one config (no hydra multirun): run it once per value, each with its own config.CHECKPOINT.DIR"
    if getattr(override.value(), "simple_form", False):
        as_list = shlex.quote(f"{key}=[{value}]")
        as_string = shlex.quote(f"{key}={hydra_quoted(value)}")
        raise ConfigError(f"override {item!r} is a sweep over {value.count(',') + 1} values; for a list write "
                          f"{as_list}, for a string holding a comma {as_string}; {once}")
    raise ConfigError(f"override {item!r} is a sweep ({value.split('(', 1)[0].strip()}); {once}")


class _StrictSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader (no python object tags) that also refuses duplicate keys, as hydra does."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a plain value, got {type(key).__name__}", key_node.start_mark
            ) from None
        if key is None:  # `null:` or `~:` (a key left empty): omegaconf refuses it later naming neither file nor line
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key is null (yaml reads a key written null, ~ or nothing as no key); name the "
                "option, or quote the key ('null') if you mean the word", key_node.start_mark
            )
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first set at line {first + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """yaml's explanation of an error, phrased for a user (unknown tags are refused, not 'missing')."""
    problem = getattr(e, "problem", None) or str(e)
    tag = re.search(r"could not determine a constructor for the tag '([^']*)'", problem)
    if tag:
        name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        if "python/" in name:
            return f"refused the tag {name}: config files hold plain values, never python objects"
        return f"unknown yaml tag {name}: config files hold plain values (no tags)"
    context = getattr(e, "context", None)
    cmark = getattr(e, "context_mark", None)
    pmark = getattr(e, "problem_mark", None)
    if context and cmark is not None and (pmark is None or cmark.line != pmark.line):
        problem = f"{problem} ({context} at line {cmark.line + 1})"
    return problem


def read_yaml_file(path: Path) -> Any:
    """A yaml file's content, loaded safely; ConfigError with file and line when it is malformed.

    Loading never constructs python objects: tags such as ``!!python/object`` are refused.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_StrictSafeLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ConfigError(f"config file {path} nests its lists or mappings too deeply to be read") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"malformed yaml in {where}: {_yaml_problem(e)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"malformed yaml in {path}: {_yaml_problem(e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not utf-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        too_big = _expanded_size(data, {}) > _MAX_EXPANDED_VALUES
    except _HoldsItself:
        raise ConfigError(f"config file {path}: an alias (*name) stands inside its own anchor (&name), so a list or "
                          f"mapping holds itself without end; write the values out") from None
    if too_big:
        raise ConfigError(f"config file {path}: its anchors and aliases (&name / *name) expand to more than "
                          f"{_MAX_EXPANDED_VALUES:,} values, which composing would copy one by one; write the values out")
    return data


# a config holds hundreds of values; a file whose aliases expand past this is an alias bomb
_MAX_EXPANDED_VALUES = 1_000_000


class _HoldsItself(Exception):
    """A yaml alias inside its own anchor: a container that holds itself."""


def _expanded_size(value: Any, sizes: Dict[int, int]) -> int:
    """The number of values ``value`` holds once every alias is copied out (an alias of the yaml
    file is the same python object as its anchor: each is counted once, then by reference)."""
    if not isinstance(value, (dict, list)):
        return 1
    known = sizes.get(id(value))
    if known == 0:
        raise _HoldsItself
    if known is not None:
        return known
    sizes[id(value)] = 0  # being counted: meeting it again inside itself is a recursive alias
    items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
    total = 1 + sum(_expanded_size(item, sizes) for item in items)
    sizes[id(value)] = total
    return total


_TOP_LEVEL = ("engine_name", "config", "defaults", "hydra", "extract_features")

#: VISSL's older engine switch: a top-level ``extract_features: True`` in its extraction files
LEGACY_EXTRACT_KEY = "extract_features"


_BOM = b"\xef\xbb\xbf"


def _check_yaml_file(path: Path, experiment: bool = False, bom_removed: bool = False, header: bool = True) -> None:
    """An experiment file must be well-formed yaml holding a mapping, with options under 'config:'.

    The file ``config=`` names (``experiment``) must also hold something: options, a
    ``defaults:`` list or an ``engine_name`` (a file that only picks the engine, the options
    coming from the command line, is fine). An empty one would run the bare defaults and fail
    later on a key the file was meant to set, naming neither the file nor the cause.
    ``bom_removed``: the file is handed to hydra as a copy without its byte order mark.
    ``header``: the file must start with ``# @package _global_`` (not asked of a file another
    one's ``defaults:`` merges, whose package hydra may place otherwise: the keys it then sets
    are named as unknown, with the file).
    """
    if not bom_removed and _starts_with_bom(path):
        raise ConfigError(
            f"config file {path} starts with a UTF-8 byte order mark (as some Windows editors save), which hydra "
            f"reads as text before '# @package _global_'; save it as UTF-8 without BOM"
        )
    data = read_yaml_file(path)
    if data is None:
        if experiment:
            raise ConfigError(f"config file {path} is empty (nothing but comments, if anything): "
                              f"an experiment file puts its options under 'config:'")
        return
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} holds a {type(data).__name__}, not a mapping; "
            f"an experiment file looks like 'config:' followed by indented options"
        )
    for key in data:
        if key not in _TOP_LEVEL:
            hint = f"; did you mean config.{key}?" if key in load_defaults()["config"] else ""
            raise ConfigError(
                f"config file {path}: unknown top-level key {key!r}; valid: {', '.join(_TOP_LEVEL)} "
                f"(options go under 'config:'){hint}"
            )
    if "config" in data and data["config"] is None:
        raise ConfigError(f"config file {path}: its 'config:' section is empty; put the options under it "
                          f"(indented), or remove the line")
    if experiment and not {"config", "defaults", "engine_name"} & set(data):
        raise ConfigError(f"config file {path} has no 'config:' section: an experiment file puts its options "
                          f"under 'config:' (or names files to compose in 'defaults:', or sets engine_name)")
    if "hydra" in data:  # VISSL composes such a file and ignores the section: so do we, with a word
        inner = data["hydra"]
        first = next(iter(inner), "") if isinstance(inner, dict) else ""
        log.warning("config file %s: its 'hydra:' section is not acted on (the tool composes the config with hydra's "
                    "compose API, as VISSL's does, not @hydra.main: hydra's run dir, verbose, job logging and sweeps "
                    "do not apply); %s", path, _hydra_setting_instead(first))
    if data.get("config") is not None and not isinstance(data["config"], dict):
        raise ConfigError(f"config file {path}: 'config:' holds a {type(data['config']).__name__}, not a mapping of options")
    if isinstance(data.get("config"), dict):
        _check_sections_are_mappings(path, data["config"], load_defaults()["config"], "config")
    if header and not _has_global_package_header(path):
        raise ConfigError(
            f"config file {path} lacks the header line '# @package _global_' before its first key; "
            f"without it hydra would read its options as config.config.*"
        )


def _default_entry_names(entry: Any) -> List[str]:
    """The config names an entry of a ``defaults:`` list merges: ``/config/quick/x``, ``grp/x``,
    ``{grp: x}`` or ``{override grp: [x, y]}`` (hydra's forms); none for ``_self_`` or a null option."""
    if isinstance(entry, str):
        return [] if entry == "_self_" else [entry]
    if not isinstance(entry, dict):
        return []
    names = []
    for key, value in entry.items():
        group = str(key).split()[-1] if str(key).split() else ""  # 'override grp', 'optional grp'
        options = value if isinstance(value, list) else [value]
        names += [f"{group}/{o}" for o in options if isinstance(o, str) and group and group != "_self_"]
    return names


def check_included_files(path: Path, group: str, search_dirs: Sequence[Path],
                         seen: Optional[Set[Path]] = None) -> List[Path]:
    """Check the files ``path``'s ``defaults:`` list merges (and theirs) as ``path`` itself is
    checked: hydra reads them with its own errors, which name no key or file ("Cannot merge
    DictConfig with ListConfig", "ConfigCompositionException") or are yaml's raw text. ``group``
    is the folder of ``path`` below the search path (``config``, ``config/quick``), against which
    hydra reads an entry without a leading ``/``. An entry that matches no file is left to hydra
    (its error is explained by :func:`_explain_missing_default`). Returns the files checked."""
    seen = set() if seen is None else seen
    data = read_yaml_file(path)
    entries = data.get("defaults") if isinstance(data, dict) else None
    checked = []
    for entry in entries if isinstance(entries, list) else []:
        for name in _default_entry_names(entry):
            rel = name[1:] if name.startswith("/") else f"{group}/{name}"
            found = next((d / f"{rel}.yaml" for d in search_dirs if (d / f"{rel}.yaml").is_file()), None)
            if found is None or found.resolve() in seen:
                continue
            seen.add(found.resolve())
            _check_yaml_file(found, header=False)
            checked += [found] + check_included_files(found, rel.rpartition("/")[0], search_dirs, seen)
    return checked


def placeholder_keys(tree: Any, prefix: str = "") -> List[str]:
    """The dotted keys a yaml file leaves ``???``, omegaconf's mark of a value still to be given."""
    if not isinstance(tree, dict):
        return []
    keys = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        keys += placeholder_keys(v, key) if isinstance(v, dict) else [key] if v == "???" else []
    return keys


def _check_placeholders_given(files: Sequence[Path], given: Set[str], merged: "_MergedFiles") -> None:
    """A ``KEY: ???`` that no later file and no override sets is an error naming the key and the
    file. hydra merges ``???`` as "no value here": the run went on with the value from before the
    file (a base experiment's num_epochs, an empty PARAMS_FILE: a random trunk), unseen."""
    for path in files:
        for key in placeholder_keys(read_yaml_file(path)):
            if not key.startswith("config.") or any(key == g or key.startswith(g + ".") for g in given):
                continue
            where, value = merged.last_setting(key)
            if where is not None and value == "???":
                raise ConfigError(
                    f"{key} is ??? in {where} (a value left to be given), and no override gives it; set it on the "
                    f"command line ({key}=...) or in the file"
                )


def _check_sections_are_mappings(path: Path, tree: Dict[str, Any], defaults: Dict[str, Any], prefix: str) -> None:
    """A list where the defaults have a section (``MACHINE: [cpu]``) would fail inside hydra's
    merge with a message that names no key; name it here."""
    for key, value in tree.items():
        default = defaults.get(key) if isinstance(key, str) else None
        where = f"{prefix}.{key}"
        if isinstance(default, list) and isinstance(value, dict):
            raise ConfigError(f"config file {path}: {where} holds a mapping, but it is a list: write it as "
                              f"{_list_example(where, default)}")
        if not isinstance(default, dict):
            continue
        if isinstance(value, list):  # a section without default options too (COLLATE_FUNCTION_PARAMS: {})
            example = f"{where}.{next(iter(default))}: ..." if default else f"{key}: {{option: value}}"
            raise ConfigError(f"config file {path}: {where} holds a list, but it is a section: expected a mapping "
                              f"of its options (e.g. {example})")
        if isinstance(value, dict) and default:
            _check_sections_are_mappings(path, value, default, where)


def _list_example(key: str, default: List[Any], override: bool = False) -> str:
    """How a list key is written: like its default when it has one, else the list form of a
    yaml file or of a command-line override."""
    if default:
        return f"a list like its default {json.dumps(default)}"
    if override:
        return f"a list ({key}=[...])"
    return f"a list ({key.rsplit('.', 1)[-1]}: [...] or one '- ' line per entry)"


def _starts_with_bom(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(3) == _BOM
    except OSError:
        return False  # read_yaml_file says why it cannot be read


def _has_global_package_header(path: Path) -> bool:
    """True when the comment block at the top of the file holds '# @package _global_'."""
    with open(path, encoding="utf-8-sig") as f:  # a BOM (Windows editors) is not text
        for line in f:
            text = line.strip()
            if not text:
                continue
            if not text.startswith("#"):
                return False
            if re.fullmatch(r"#\s*@package\s+_global_\s*", text):
                return True
    return True  # an empty file or only comments: nothing to misplace


def _resolve_experiment(value: str, tmp: Path) -> Tuple[str, List[Path], Path]:
    """Map the value of ``config=`` to (group option, extra search dirs, the file)."""
    value = value.strip()
    if not value:
        near = known_experiments()[:6]
        raise ConfigError(f"config= is empty: name an experiment file, e.g. {', '.join('config=' + n for n in near)}")
    as_path = expand_user(value, "config")
    if value.endswith((".yaml", ".yml")) and (as_path.is_file() or as_path.is_absolute()):
        if not as_path.is_file():
            _refuse_folder(value, value)
            if as_path.is_symlink():
                raise ConfigError(f"config={value} is a symbolic link to {os.readlink(as_path)}, which is no readable "
                                  f"file; fix the link or name the file itself")
            near = sorted(p.name for p in as_path.parent.glob("*.y*ml") if p.is_file()) if as_path.parent.is_dir() else []
            near = closest(as_path.name, near, n=3)
            hint = f"; nearest in {as_path.parent}: {', '.join(near)}" if near else ""
            raise ConfigError(f"config={value}: no such file{hint}")
        _check_yaml_file(as_path, experiment=True, bom_removed=True)
        # Present the user's file to hydra as an option of the `config` group (without a BOM).
        (tmp / "config").mkdir(parents=True, exist_ok=True)
        text = as_path.read_bytes()
        (tmp / "config" / f"{_USER_FILE}.yaml").write_bytes(text[len(_BOM):] if text.startswith(_BOM) else text)
        return _USER_FILE, [tmp], as_path
    name = value[:-5] if value.endswith(".yaml") else value
    for d in config_search_dirs():
        f = d / "config" / f"{name}.yaml"
        if f.is_file():
            _check_yaml_file(f, experiment=True)
            return name, [], f
    if name.endswith(".yml"):  # hydra's search path holds .yaml files only
        for d in config_search_dirs():
            f = d / "config" / name
            if f.is_file():
                raise ConfigError(f"config={value}: {f} ends in .yml, and the config folders are searched for .yaml "
                                  f"files only; rename it to {f.with_suffix('.yaml').name}, or give its path: "
                                  f"config={f}")
        name = name[:-4]
    _refuse_folder(value, name)
    if as_path.is_file() and as_path.suffix in (".yaml", ".yml"):  # a '/' after the file's name (pathlib drops it)
        raise ConfigError(f"config={value} names the file {as_path} as a folder ('/' after its name); "
                          f"write config={value.rstrip('/')}")
    if as_path.is_file():  # the user's file, without the ending a config file is known by
        raise ConfigError(f"config={value} is a file without a .yaml ending: a config file outside the config folders "
                          f"is read by its path ending in .yaml (or .yml); rename it to {as_path.name}.yaml")
    if _written_as_path(value):  # not a name of the search path: no file there would be found
        ending = "" if value.endswith((".yaml", ".yml")) else " (nor with .yaml added)"
        near = sorted(p.name for p in as_path.parent.glob("*.y*ml") if p.is_file()) if as_path.parent.is_dir() else []
        near = closest(as_path.name + (".yaml" if ending else ""), near, n=3)
        hint = f"; nearest in {as_path.parent}: {', '.join(near)}" if near else ""
        raise ConfigError(f"config={value}: no such file{ending}{hint}")
    near = closest(name, known_experiments(), n=3)
    hint = f"; nearest: {', '.join(near)}" if near else ""
    if not name.endswith("/") and as_path.with_name(as_path.name + ".yaml").is_file():
        hint += f"; the file {as_path}.yaml is named by its path: config=./{name}.yaml"
    dirs = ", ".join(str(d / "config") for d in config_search_dirs()) or "(no configs/config folder found)"
    raise ConfigError(f"config={value} matches no file under {dirs}{hint}; {search_path_note(f'config/{name}.yaml')}")


def _refuse_folder(value: str, name: str) -> None:
    """``config=`` naming a folder (a path, or a folder of the config search path such as
    ``quick``): say so, with the yaml files in it that it could name instead."""
    name = os.path.normpath(name) if name else name
    relative = bool(name) and not expand_user(name, "config").is_absolute()
    in_search_path = [d / "config" / name for d in config_search_dirs() if relative and (d / "config" / name).is_dir()]
    if in_search_path:  # named as experiments are (config=quick/simclr_digits); config folders are small
        where = ", ".join(map(str, in_search_path))
        prefix = "" if name == "." else f"{name}/"
        names = sorted({f"{prefix}{p.relative_to(f).with_suffix('')}" for f in in_search_path for p in f.rglob("*.yaml")})
    elif (folder := expand_user(value, "config")).is_dir():  # named as a path (config=/any/path/file.yaml): its own files only
        where = str(folder)
        names = sorted(f"{value.rstrip('/')}/{p.name}" for p in folder.iterdir()
                       if p.suffix in (".yaml", ".yml") and p.is_file())
    else:
        return
    shown = ", ".join(f"config={n}" for n in names[:_FOLDER_LISTED]) + (", ..." if len(names) > _FOLDER_LISTED else "")
    listing = f"; name one of its yaml files: {shown}" if names else "; it holds no yaml files"
    raise ConfigError(f"config={value} is a folder ({where}), not a yaml file{listing}")


_FOLDER_LISTED = 10
_USER_FILE = "user_file"


def _resolve_overlay(group: str, value: str, search_dirs: Optional[List[Path]] = None) -> Tuple[str, Path]:
    """``+config/<group>=<name>``: the file ``<group>/<name>.yaml`` of a config folder, merged
    over the experiment (VISSL's way of adding e.g. feature_extraction/trunk_only=rn50_layers)."""
    dirs = config_search_dirs() if search_dirs is None else search_dirs
    name = value.strip()
    name = name[:-5] if name.endswith(".yaml") else name
    if ".." in Path(group).parts or ".." in Path(name).parts:  # hydra cannot name such a group either
        raise ConfigError(f"+{group}={value}: a config group is a folder of the config search path, without '..'; "
                          f"for a yaml file elsewhere use config=/path/to/file.yaml, or list it in a file's "
                          f"'defaults:', or set SSL_ENGINE_CONFIG_DIR to a folder holding config/<group>/<name>.yaml")
    options = sorted({p.stem for d in dirs if (d / group).is_dir() for p in (d / group).glob("*.yaml")})
    if not name or Path(name).is_absolute() or name.startswith("~"):
        # d / group / "/abs/x.yaml" would be the absolute path itself, and hydra cannot find it
        what = "names no file" if not name else "is a path, but a group's option is the name of a yaml file in it"
        shown = f"options there: {', '.join(options[:12]) if options else 'none'}"
        raise ConfigError(f"+{group}={value} {what} ({group}/<name>.yaml of the config search path; {shown}); "
                          f"for a yaml file elsewhere use config=/path/to/file.yaml, or list it in a file's 'defaults:'")
    for d in dirs:
        f = d / group / f"{name}.yaml"
        if f.is_file():
            _check_yaml_file(f)
            return name, f
    where = ", ".join(str(d / group) for d in dirs)
    hint = f"; options there: {', '.join(options[:12])}" if options else ""
    raise ConfigError(f"+{group}={value} matches no file {name}.yaml under {where}{hint}; "
                      f"{search_path_note(f'{group}/{name}.yaml')}")


def search_path_note(wanted: str) -> str:
    """How the config search path is made, and what SSL_ENGINE_CONFIG_DIR adds to it (or why
    the folder it names was left out): the part of a 'no such config' message that says where
    else a file could go."""
    env = os.environ.get("SSL_ENGINE_CONFIG_DIR")
    order = "the search path is $SSL_ENGINE_CONFIG_DIR/config, ./configs/config, then the package's configs/config"
    if not env:
        return f"{order}; SSL_ENGINE_CONFIG_DIR is not set (set it to a folder holding {wanted})"
    if not (Path(env) / "config").is_dir():
        return f"{order}; SSL_ENGINE_CONFIG_DIR={env} was left out: it has no config/ folder"
    return f"{order}; SSL_ENGINE_CONFIG_DIR={env}"


def _hydra_compose(overrides: List[str], search_dirs: Iterable[Path], user_file: Optional[str] = None) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    search_dirs = list(search_dirs)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(DEFAULTS_DIR), version_base=None):
            cfg = hydra_compose(config_name="defaults", overrides=_with_search_path(overrides, search_dirs))
            return OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # hydra/omegaconf raise many types on bad input; all of them are the input's fault
        missing = _explain_missing_default(" ".join(str(e).split()), user_file)
        if missing:
            raise ConfigError(missing) from None
        text = " ".join(str(e).split())
        msg = (_explain_missing_interpolation(text, overrides, search_dirs) or _explain_unset_variable(text)
               or _explain_hydra_error(e))
        if user_file:
            msg = re.sub(r"\S*/config/" + _USER_FILE + r"\.yaml", user_file, msg)
            msg = msg.replace(f"config/{_USER_FILE}", user_file)
        raise ConfigError(msg) from None
    finally:
        GlobalHydra.instance().clear()


def _with_search_path(overrides: List[str], search_dirs: Iterable[Path]) -> List[str]:
    paths = ",".join(f"file://{d}" for d in search_dirs)
    return [f"hydra.searchpath=[{paths}]"] + overrides


def _merged_files(overrides: List[str], search_dirs: Iterable[Path]) -> List[Tuple[str, Any]]:
    """(path, content) of each yaml file that composing ``overrides`` merges, in hydra's merge order
    (an experiment's ``defaults:`` entries, its own body at ``_self_``, then ``+config/<group>``
    files), each placed at its package; the engine's defaults.yaml and hydra's own files left out.
    Empty where hydra's loader cannot say (the caller then knows only the ``+config`` files' order).

    The older layout's keys are moved to their new places after composing, where the order of
    the files is lost: this order says which of an older key and its new place was set last."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        from hydra._internal.defaults_list import create_defaults_list

        with initialize_config_dir(config_dir=str(DEFAULTS_DIR), version_base=None):
            loader = GlobalHydra.instance().config_loader()
            parsed, repo = loader._parse_overrides_and_create_caching_repo(
                "defaults", _with_search_path(overrides, search_dirs))
            merged = create_defaults_list(repo=repo, config_name="defaults", overrides_list=parsed,
                                          prepend_hydra=False, skip_missing=False)
            files = []
            for d in merged.defaults:
                if d.primary or (d.config_path or "").startswith("hydra/"):
                    continue
                loaded = loader._load_single_config(d, repo)
                source = re.sub(r"^file://", "", str(loaded.path))
                files.append((os.path.join(source, f"{d.config_path}.yaml"), OmegaConf.to_container(loaded.config)))
            return files
    except Exception:  # noqa: BLE001 - hydra's internals differ: fall back to what the caller knows
        log.debug("cannot list the merged yaml files in order", exc_info=True)
        return []
    finally:
        GlobalHydra.instance().clear()


def _explain_missing_default(msg: str, user_file: Optional[str]) -> Optional[str]:
    """hydra's "In 'config/x': Could not load 'config/y'." (an entry of a yaml file's
    ``defaults:`` list that matches no file) as one line naming the yaml file, the entry and
    the folders searched; None for any other error."""
    m = re.match(r"In '([^']+)': Could not load '([^']+)'", msg)
    if not m:
        return None
    parent, entry = m.groups()
    if parent == f"config/{_USER_FILE}" and user_file:
        where = user_file
    else:
        found = [d / f"{parent}.yaml" for d in config_search_dirs() if (d / f"{parent}.yaml").is_file()]
        where = str(found[0]) if found else f"{parent}.yaml"
    dirs = ", ".join(str(d) for d in config_search_dirs()) or "(no configs/config folder found)"
    group, _, option = entry.rpartition("/")
    options = sorted({p.stem for d in config_search_dirs() if (d / group).is_dir() for p in (d / group).glob("*.yaml")})
    near = closest(option, options, n=3)
    hint = f"; nearest in {group}/: {', '.join(near)}" if near else ""
    if parent == f"config/{_USER_FILE}" and user_file and entry.startswith("config/"):
        # the user's file given by its path: an entry written as a name beside it ('- base')
        beside = expand_user(user_file, "config").parent / f"{entry[len('config/'):]}.yaml"
        if beside.is_file():
            hint += (f"; the file {beside} beside it is not read: entries name files of the config folders, "
                     f"not of the file's own folder; put both files in a folder named config/ (a file given by "
                     f"its path in a config/ folder finds the files of that folder)")
    return (f"config file {where}: its defaults: entry {entry} matches no file {entry}.yaml under {dirs}{hint} "
            f"(entries are paths below these folders, e.g. /config/quick/simclr_digits)")


def _explain_missing_interpolation(msg: str, overrides: List[str], search_dirs: List[Path]) -> Optional[str]:
    """An interpolation naming no key (``${config.OPTIMIZER.num_epoch}``): omegaconf names the key
    looked up and the key holding the interpolation; the line adds the value as written, where it
    was written (the command line or the yaml file that set it last) and the closest valid keys."""
    m = re.search(r"Interpolation key '([^']+)' not found full_key: (\S+)", msg)
    if not m:
        return None
    target, holder = m.groups()
    known = flatten_keys(load_defaults())
    # an absolute path as written; a relative one (${..x}) reaches omegaconf's message as its last part
    absolute = target.split(".", 1)[0] in _TOP_LEVEL
    near = nearest_keys(target if absolute else f"{holder.rpartition('.')[0]}.{target}", known)
    hint = f" (closest: {', '.join('${' + k + '}' for k in near)})" if near else ""
    given = [i.partition("=")[2] for i in overrides if i.partition("=")[0].lstrip("+~") == holder]
    if given:
        written, where = given[-1], "on the command line"
    else:
        found = _setting_in(_merged_files(overrides, search_dirs), holder)
        written, where = (found[1], f"in {found[0]}") if found else (f"${{{target}}}", "in a config file")
    return (f"{holder}={written}, set {where}: its interpolation names no key {target}{hint}; an interpolation "
            f"names a key by its full path, e.g. ${{config.SEED_VALUE}}")


def _explain_unset_variable(msg: str) -> Optional[str]:
    """``${oc.env:NAME}`` of a variable that is not set: omegaconf's KeyError text, made the line that
    names the key, the variable and the two ways out."""
    m = re.search(r"Environment variable '([^']+)' not found\W* full_key: (\S+)", msg)
    if not m:
        return None
    name, holder = m.groups()
    return (f"{holder}: its interpolation ${{oc.env:{name}}} names the environment variable {name}, which is not "
            f"set; set it, or give a default after a comma: ${{oc.env:{name},<default>}}")


def _setting_in(files: List[Tuple[str, Any]], key: str) -> Optional[Tuple[str, Any]]:
    """(path, value) of the last of the merged ``files`` (path, content) that sets the dotted ``key``."""
    parts = key.split(".")
    for path, content in reversed(files):
        node = content
        for part in parts:
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            return path, node
    return None


def _explain_hydra_error(e: Exception) -> str:
    msg = " ".join(str(e).split())
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(r"Key '([^']+)' is not in struct", msg)
    if m:
        known = flatten_keys(load_defaults())
        whole = re.search(r"To append to your config use \+(\S+?)=(.*)$", msg)
        if whole and m.group(1) in known:
            explained = _section_given_whole(m.group(1), whole.group(2), known)
            if explained:
                return explained
        return unknown_key_message(m.group(1), known)
    m = re.search(r"Could not delete from config\. '([^']+)' does not exist", msg)
    if m:
        return f"~{m.group(1)} deletes a key the config does not have; " + unknown_key_message(
            m.group(1), flatten_keys(load_defaults()), added_hint=False)
    m = re.search(r"Could not delete from config\. The value of '([^']+)' is (.*) and not (.*)\.$", msg)
    if m:
        return (f"~{m.group(1)}={m.group(3)} deletes the key only when it holds that value, and it holds "
                f"{m.group(2)}; use ~{m.group(1)} to delete it whatever it holds")
    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", msg)
    if m:
        return f"+{m.group(1)}=... adds a key that already exists; set it with {m.group(1)}=... instead"
    mismatch = _explain_type_mismatch(e)
    if mismatch:
        return mismatch
    msg = msg.split(" Config search path:")[0]
    return f"cannot compose the config: {msg or type(e).__name__}"


def _section_given_whole(section: str, value: str, known: List[str]) -> Optional[str]:
    """A section set whole on the command line (``config.OPTIMIZER={foo: 1}``) with a key it lacks:
    name the keys, the closest known ones, and how to add them (hydra only says it cannot override).

    The value is read back with hydra's override grammar, as hydra read it: yaml would take the
    unspaced ``{momentm:0.9}`` for one key ``momentm:0.9`` and name a known key as unknown."""
    try:
        given = _overrides_parser().parse_override(f"{section}={value}").value()
    except Exception:  # hydra parsed it once already; anything else leaves hydra's own message
        given = None
    new = [str(k) for k in given if f"{section}.{k}" not in known] if isinstance(given, dict) else []
    if not new:
        return None
    children = [k[len(section) + 1:] for k in known if k.startswith(section + ".") and "." not in k[len(section) + 1:]]
    near = sorted({c for k in new for c in closest(k, children, n=2)})
    adds = " ".join(_override_word(f"+{section}.{k}", given[k]) for k in new)
    return (f"{section}={value} holds {'keys' if len(new) > 1 else 'a key'} {section} does not have: "
            f"{', '.join(new)}" + (f" (closest: {', '.join(near)})" if near else "")
            + f"; fix the {'names' if len(new) > 1 else 'name'}, or add {'them' if len(new) > 1 else 'it'} as your own with {adds}")


def _override_word(key: str, value: Any) -> str:
    """``key=value`` as one shell word that hydra's grammar reads back as ``value`` (a string with
    a space or a comma quoted for hydra, a list or mapping written without spaces)."""
    if isinstance(value, str):
        text = value
        try:
            if _overrides_parser().parse_override(f"{key}={value}").value() != value:
                text = hydra_quoted(value)
        except Exception:  # not a bare value of the grammar
            text = hydra_quoted(value)
    else:
        text = json.dumps(value, separators=(",", ":"))
    return shlex.quote(f"{key}={text}")


def _explain_type_mismatch(e: Exception) -> Optional[str]:
    """omegaconf's "Cannot merge DictConfig with ListConfig" (a mapping given where the defaults
    have a list, or a list where they have a section) names the key in the error's cause."""
    chain = " ".join(" ".join(str(x).split()) for x in (e, e.__cause__, e.__context__) if x is not None)
    m = re.search(r"Cannot merge \w+Config with \w+Config full_key: (\S*) object_type=(\w+)", chain)
    if not m:
        return None
    key, expected = m.group(1), m.group(2)
    given = "a mapping" if expected == "list" else "a list"
    override = re.search(r"Error merging override (.+?) Cannot merge", chain)
    # the override as the user gave it: the ++ the tool adds for free-form sections is its own
    where = re.sub(r"^\+\+", "", override.group(1)) if override else "a config file"
    if not key:
        return (f"{where} gives {given} where the config has {'a list' if expected == 'list' else 'a section'} "
                f"(hydra does not say which key); check that file's keys against the README's tables")
    default: Any = load_defaults()
    for part in key.split("."):
        default = default.get(part) if isinstance(default, dict) else None
    if expected == "list":
        how = _list_example(key, default if isinstance(default, list) else [], override=bool(override))
        return f"{where} gives a mapping, but {key} is a list: write it as {how}"
    return f"{where} gives {given}, but {key} is a section of options: set them one by one ({key}.<OPTION>=...)"


def _free_form_sections() -> List[str]:
    """Sections that are ``{}`` in defaults.yaml: their keys are a part's own options (VISSL's
    ``MODEL.TRUNK.REGNET: {name: regnet_y_400mf}``, a collator's COLLATE_FUNCTION_PARAMS, sbatch's
    options in SLURM.ADDITIONAL_PARAMETERS), which a yaml file gives as they are; the command line
    sets them, or the whole mapping, without '+' too (hydra's struct mode refused any key of theirs)."""
    found: List[str] = []

    def walk(node: Dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                if v:
                    walk(v, f"{prefix}{k}.")
                else:
                    found.append(f"{prefix}{k}")

    walk(_defaults_cached(DEFAULTS_FILE.stat().st_mtime_ns), "")  # read only: no copy per override
    return found


def _is_option_of_free_form_section(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in _free_form_sections())


def _is_inside_unacted_section(key: str) -> bool:
    """A key inside a section marked [compat] (VISSL's ``REPRODUCIBILITY: {}``, ``SVM: {}``, the
    options of a VISSL loss this engine lacks) that defaults.yaml does not list: a yaml file may
    set it (kept, with the not-acted-on warning), so the command line may too, without '+'."""
    return _compat_ancestor(key) is not None and key not in flatten_keys(load_defaults())


#: what a hydra setting on the command line would do under @hydra.main, and the engine's key for it
_HYDRA_SETTING_INSTEAD = {
    "verbose": "for DEBUG-level logs use config.VERBOSE=true",
    "run": "the run's folder is config.CHECKPOINT.DIR",
    "sweep": "the run's folder is config.CHECKPOINT.DIR (the tool runs one config, no sweeps)",
    "output_subdir": "the resolved config is written to config.CHECKPOINT.DIR/train_config.yaml",
    "searchpath": "add config folders with $SSL_ENGINE_CONFIG_DIR (or config=/path/to/file.yaml)",
    "job_logging": "the log goes to config.CHECKPOINT.DIR/log.txt",
    "hydra_logging": "the log goes to config.CHECKPOINT.DIR/log.txt",
}


def _hydra_setting_instead(name: str) -> str:
    """What to use instead of hydra's setting ``name`` (``run``, ``verbose``, ...)."""
    return _HYDRA_SETTING_INSTEAD.get(name, "set the engine's options under config. (see defaults.yaml)")


def _refuse_hydra_setting(item: str, key: str) -> None:
    """``hydra.verbose=true``, ``hydra.run.dir=/x``, ...: the tool composes with hydra's compose
    API, not ``@hydra.main``, so hydra's own settings (run dir, job logging, sweeps) never act;
    taking them would ignore what the user asked for."""
    parts = key.lstrip("+~").split(".")
    if parts[0] != "hydra":
        return
    instead = _hydra_setting_instead(parts[1] if len(parts) > 1 else "")
    raise ConfigError(
        f"override {item!r} is not acted on: the tool composes the config with hydra's compose API, not "
        f"@hydra.main, so hydra's own settings (hydra.run.dir, hydra.verbose, job logging, sweeps) do not "
        f"apply; {instead}"
    )


def _check_top_level(key: str) -> None:
    """An override's first part is a top-level key: ``LOG_FREQUENCY=2`` (or ``+LOG_FREQUENCY=2``,
    which hydra would add beside ``config`` where nothing reads it) names the option it meant."""
    top = key.split(".", 1)[0]
    if top in _TOP_LEVEL:
        return
    known = flatten_keys(load_defaults())
    rest = key.split(".", 1)[1] if "." in key and top.lower() == "config" else key
    meant = f"config.{rest}"
    tops = ", ".join(k for k in _TOP_LEVEL if k != "hydra")
    if meant in known:
        raise ConfigError(f"{key}: {top!r} is not a top-level key; the engine's options are under config.: "
                          f"did you mean {meant}=...?")
    near = nearest_keys(meant, known)
    raise ConfigError(
        f"{key}: {top!r} is not a top-level key (those are: {tops}); the engine's options are under config., "
        f"as in config.LOG_FREQUENCY=10" + (f" (closest: {', '.join(near)})" if near else "")
    )


def compose(overrides: Optional[List[str]] = None, warn_unused: bool = True) -> AttrDict:
    """Compose, validate and return the config (the ``config:`` node plus ``engine_name``).

    Raises ConfigError (a UserError) with one clear line for anything the user can fix.
    """
    overrides = list(overrides or [])
    hydra_overrides: List[str] = []
    added_keys: List[str] = []
    command_line: List[str] = []  # the overrides' keys: they win over a yaml file's older layout
    experiment: Optional[str] = None
    overlay_files: List[Path] = []
    yaml_files: List[Path] = []  # the experiment's, overlays' and those their defaults: lists merge
    deleted: List[str] = []  # keys a ~config.X override deleted
    remove_stale_scratch_folders()
    with tempfile.TemporaryDirectory(prefix=scratch_folder_prefix(os.getpid())) as tmpdir:
        extra_dirs: List[Path] = []
        overrides = [f"config={with_yaml_ending(i.partition('=')[2])}" if i.partition("=")[0] == "config" else i
                     for i in overrides]
        given = [i.partition("=")[2] for i in overrides if i.partition("=")[0] == "config"]
        search_dirs = config_search_dirs(own_config_tree(given[-1] if given else None))
        for item in overrides:
            key, value = _split_override(item)
            if key == "config":
                experiment = value  # the last config= wins, as with hydra (a script's default, then the user's)
                continue
            if key.startswith("+config/"):
                option, overlay = _resolve_overlay(key[1:], value, search_dirs)
                yaml_files += [overlay] + check_included_files(overlay, key[1:], search_dirs)
                added_keys += declared_added_keys(overlay)
                overlay_files.append(overlay)
                hydra_overrides.append(f"{key}={option}")
                continue
            _refuse_hydra_setting(item, key)
            _check_list_entry_key(key)
            _check_override_grammar(item)
            _check_top_level(key.lstrip("+~"))
            if key.startswith("~"):
                deleted.append(key.lstrip("~"))
                hydra_overrides.append(item)
                continue
            if is_older_layout_key(key):
                # not in the defaults, so hydra wants '+' (or, when the experiment file has the
                # key, no '+'): '++' is both; validate() then moves it as it moves a yaml file's
                hydra_overrides.append(f"++{key}={value}")
                continue
            if key.startswith("+"):
                added_keys.append(key.lstrip("+"))
            command_line.append(key)
            if any(key == d or key.startswith(d + ".") for d in deleted):
                key = f"++{key}"  # set again after ~ deleted it: hydra's struct mode no longer has the key
            elif _is_option_of_free_form_section(key) or (not key.startswith("+") and _is_inside_unacted_section(key)):
                key = f"++{key}"  # not in defaults.yaml's {}, so hydra wants '+' (or none when a yaml set it)
            elif not key.startswith("+") and key.rsplit(".", 1)[-1].isdigit() and value.lstrip().startswith("{"):
                # an entry of a list given whole: hydra's struct mode would refuse a mapping with options
                # the old entry lacks ({name: RandomHorizontalFlip, p: 0.3} over ToTensor); it merges
                # the mapping into the entry
                key = f"++{key}"
            hydra_overrides.append(f"{key}={value}")
        user_file = None
        if experiment is not None:
            option, extra_dirs, experiment_file = _resolve_experiment(experiment, Path(tmpdir))
            yaml_files[:0] = [experiment_file] + check_included_files(
                experiment_file, f"config/{option}".rpartition("/")[0], extra_dirs + search_dirs)
            added_keys += declared_added_keys(experiment_file)
            hydra_overrides.insert(0, f"config={option}")
            user_file = experiment.strip() if option == _USER_FILE else None
        try:
            root = _hydra_compose(hydra_overrides, extra_dirs + search_dirs, user_file)
        except ConfigError as e:
            if command_line and (str(e).startswith("unknown config key") or _names_a_list_entry(str(e))):
                _explain_override_into_a_value(hydra_overrides, command_line, extra_dirs + search_dirs, user_file)
            raise
        merged = _MergedFiles(hydra_overrides, extra_dirs + search_dirs, user_file, Path(tmpdir))
        root.pop("hydra", None)
        _read_legacy_extract_switch(root, engine_on_command_line="engine_name" in command_line)
        if not isinstance(root.get("config"), dict):
            raise ConfigError("the composed config has no 'config:' node; experiment files put options under 'config:'")
        older_on_command_line = [k for k in (_split_override(i)[0].lstrip("+") for i in overrides)
                                 if is_older_layout_key(k)]
        kept = command_line
        if any(is_older_layout_key(k) for k in flatten_keys(root)):  # which file set what last decides
            files = merged.contents() or [read_yaml_file(f) for f in overlay_files]
            kept = command_line + keys_set_at_new_places(files, older_on_command_line)
        set_here = {k.lstrip("+~") for k in command_line}
        _check_placeholders_given(yaml_files, set_here | set(deleted), merged)
        return validate(root, load_defaults(), added_keys=added_keys, warn_unused=warn_unused, command_line=kept,
                        where=lambda key: None if key in set_here else merged.setting(key))


class _MergedFiles:
    """The yaml files a compose merged, listed on first use (see :func:`_merged_files`): which
    file set an older-layout key last, and which set a key that is wrong (named in the error)."""

    def __init__(self, overrides: List[str], search_dirs: List[Path], user_file: Optional[str], tmp: Path) -> None:
        self._args = (overrides, search_dirs)
        self._user_file = user_file
        self._tmp = tmp
        self._files: Optional[List[Tuple[str, Any]]] = None

    def _list(self) -> List[Tuple[str, Any]]:
        if self._files is None:
            self._files = _merged_files(*self._args)
        return self._files

    def contents(self) -> List[Any]:
        return [content for _, content in self._list()]

    def setting(self, key: str) -> Optional[str]:
        """The last merged file that sets the dotted ``key`` (the user's own file by the path given)."""
        return self.last_setting(key)[0]

    def last_setting(self, key: str) -> Tuple[Optional[str], Any]:
        """(the last merged file that sets the dotted ``key``, the value it gives); (None, None) if none."""
        found = _setting_in(self._list(), key)
        if found is None:
            return None, None
        path, value = found
        if self._user_file and Path(path).resolve().is_relative_to(self._tmp.resolve()):
            return self._user_file, value
        return path, value


_MISSING = object()


def _explain_override_into_a_value(hydra_overrides: List[str], command_line: List[str], search_dirs: List[Path],
                                   user_file: Optional[str]) -> None:
    """hydra calls an override into a section that a yaml file set to a plain value (``OPTIMIZER: 5``
    with ``config.OPTIMIZER.num_epochs=1``) an unknown key. Compose the files alone and, where such
    a value is on the override's path, raise the line that names it; return otherwise.

    Each override is looked at in the config as the overrides before it left it: one that sets a
    whole list (``TRANSFORMS=[...]``) changes the entries a later ``TRANSFORMS.5.size`` can name."""
    files = [o for o in hydra_overrides if o.startswith(("config=", "+config/"))]
    as_given = {k.lstrip("+~"): k for k in command_line}
    bases: Dict[int, Any] = {}
    before: List[str] = []
    for item in hydra_overrides:
        if item in files:
            continue
        path = item.partition("=")[0].lstrip("+~")
        key = as_given.get(path)
        if key is not None:
            # the files alone, unless an earlier override set this key or a section or list above it
            reach = [o for o in before if path == (p := o.partition("=")[0].lstrip("+~")) or path.startswith(p + ".")]
            n = len(before) if reach else 0
            if n not in bases:
                try:
                    bases[n] = _hydra_compose(files + before[:n], search_dirs, user_file)
                except ConfigError:
                    return
            _explain_override_in(bases[n], key, user_file)
        before.append(item)


def _explain_override_in(base: Dict[str, Any], key: str, user_file: Optional[str]) -> None:
    """The line for the command-line ``key`` that has no place in the composed ``base``: an entry
    of a list it lacks or an option the entry lacks, or a plain value where a section belongs."""
    node: Any = base
    parts = key.lstrip("+~").split(".")
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):  # an entry of a list (TRANSFORMS.1.size): the part is its index
            node = _list_entry(node, ".".join(parts[:depth]), part, key)
            if isinstance(node, dict) and depth == len(parts) - 2 and parts[-1] not in node:
                near = closest(parts[-1], [str(k) for k in node if k != "name"], n=2)
                raise ConfigError(
                    f"{key}: entry {part} of {'.'.join(parts[:depth])} ({_entry_name(node)}) has no option "
                    f"{parts[-1]!r} to change" + (f" (closest: {', '.join(near)})" if near else "")
                    + f"; add it with +{key.lstrip('+')}=<value>"
                )
            continue
        node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, (dict, list)):
            where = ".".join(parts[:depth + 1])
            raise ConfigError(
                f"{where}={node!r} has the wrong type: expected mapping, got {type(node).__name__} "
                f"(in {_file_setting(user_file, parts[:depth + 1]) or 'the config files'}), so {key} on the "
                f"command line has no section to go into; make {where} a section of options"
            )
        if node is None:
            break
    if isinstance(node, list) and len(parts) > 1:  # the key names an entry itself (TRANSFORMS.7={...})
        _list_entry(node, ".".join(parts[:-1]), parts[-1], key)


def _check_list_entry_key(key: str) -> None:
    """A ConfigError for the list-entry keys hydra cannot act on: a negative index, and the
    deletion of one entry (hydra deletes keys of sections, not entries of lists)."""
    parts = key.lstrip("+~").split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        if re.fullmatch(r"-\d+", part):
            raise ConfigError(
                f"{key}: entries of {where} are named by their index counted from 0 ({where}.0, {where}.1, ...); "
                f"a negative index is not supported"
            )
        if key.startswith("~") and depth and part.isdigit():
            what = ("an entry of the list {where} cannot be deleted on its own" if depth == len(parts) - 1 else
                    "hydra deletes keys of sections, not options inside an entry of the list {where}")
            raise ConfigError(
                f"{key}: {what.format(where=where)}; give the list as you want it, {where}=[...] (quoted as one "
                f"shell word)"
            )


def _names_a_list_entry(message: str) -> bool:
    """hydra's errors for an override into a list entry it cannot find (index out of range, not a number)."""
    return message.startswith("cannot compose the config: ") and (
        "Error merging override" in message or "is not an int" in message)


def _list_entry(items: List[Any], where: str, part: str, key: str) -> Any:
    """``items[int(part)]``; a ConfigError naming the valid indices when ``part`` is none of them."""
    if part.isdigit() and int(part) < len(items):
        return items[int(part)]
    valid = f"0-{len(items) - 1}" if len(items) > 1 else "0" if items else "none: the list is empty"
    raise ConfigError(
        f"{key}: {where} is a list of {len(items)} entries, so {part!r} names none of them (indices: {valid}); "
        f"to change the whole list, give it as {where}=[...]"
    )


def _entry_name(entry: Dict[str, Any]) -> str:
    return f"name {entry['name']}" if "name" in entry else "a section"


def _file_setting(user_file: Optional[str], parts: List[str]) -> Optional[str]:
    """``user_file`` when it sets the key ``parts`` itself (not through its defaults list)."""
    if not user_file:
        return None
    try:
        node: Any = read_yaml_file(expand_user(user_file, "config"))
    except ConfigError:
        return None
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return user_file


def _read_legacy_extract_switch(root: Dict[str, Any], engine_on_command_line: bool) -> None:
    """Read (and remove) a top-level ``extract_features: True``, as some of VISSL's extraction
    files still carry it: the engine becomes ``extract_features`` unless ``engine_name`` names
    another one on the command line or in a file. One warning says which way it was read."""
    if LEGACY_EXTRACT_KEY not in root:
        return
    value = root.pop(LEGACY_EXTRACT_KEY)
    if not isinstance(value, bool):
        raise ConfigError(f"{LEGACY_EXTRACT_KEY}={value!r} (a top-level key of VISSL's older extraction files) "
                          f"must be true or false; the engine is chosen with engine_name=extract_features")
    engine = root.get("engine_name", "train")
    if not value or engine == "extract_features":
        return
    if engine == "train" and not engine_on_command_line:
        root["engine_name"] = "extract_features"
        log.warning("top-level extract_features: true (VISSL's older layout) is read as engine_name=extract_features")
    else:
        log.warning("top-level extract_features: true is not acted on: engine_name=%s is given", engine)


def to_yaml(cfg: AttrDict) -> str:
    """The resolved config as a yaml document that ``config=/path/file.yaml`` can read back.

    Keys the run added with '+' are named on an ``# added keys:`` line, so reading the file
    back accepts them without '+' again.
    """
    data = cfg.to_dict() if isinstance(cfg, AttrDict) else dict(cfg)
    engine = data.pop("engine_name", "train")
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml when there: 5x faster, same text
    body = yaml.dump({"engine_name": engine, "config": data}, Dumper=dumper, sort_keys=False)
    added = keys_beyond_defaults({"config": data}, load_defaults())
    header = f"{ADDED_KEYS_MARKER} {', '.join(added)}\n" if added else ""
    return "# @package _global_\n" + header + body


ADDED_KEYS_MARKER = "# added keys:"


def declared_added_keys(path: Path) -> List[str]:
    """The keys a yaml file declares as its own in its leading comments
    (``# added keys: config.A, config.B``): accepted as if given with '+'."""
    keys: List[str] = []
    with open(path, encoding="utf-8-sig") as f:
        for line in f:
            text = line.strip()
            if text and not text.startswith("#"):
                break
            if text.startswith(ADDED_KEYS_MARKER):
                keys += [k.strip() for k in text[len(ADDED_KEYS_MARKER):].split(",") if k.strip()]
    return keys
