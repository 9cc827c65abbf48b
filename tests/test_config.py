"""Config composition and validation, in-process: VISSL-style yaml, overrides, unknown keys with
the closest names, types, ranges, `+key` additions, config=/abs/path.yaml, [compat] warnings,
and the one-line messages the command-line tool prints."""

import logging
import re
import textwrap
from pathlib import Path

import pytest

from ssl_engine.config import compose, to_yaml
from ssl_engine.config.validate import compat_keys, nearest_keys
from ssl_engine.errors import ConfigError, UserError, one_line, unwrap_worker_error

QUICK = "config=quick/supervised_digits"


def write_yaml(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def test_vissl_style_yaml_composes_with_overrides(tmp_path):
    path = write_yaml(tmp_path, "vissl_style.yaml", """\
        # @package _global_
        engine_name: train
        config:
          DATA:
            NUM_DATALOADER_WORKERS: 0
            TRAIN:
              DATA_SOURCES: [synthetic]
              LABEL_SOURCES: [synthetic]
              DATASET_NAMES: [imagenet1k_folder]
              BATCHSIZE_PER_REPLICA: 32
              TRANSFORMS:
                - name: ToTensor
          MODEL:
            TRUNK:
              NAME: resnet
              RESNETS:
                DEPTH: 18
            HEAD:
              PARAMS: [[mlp, {dims: [512, 10]}]]
          OPTIMIZER:
            name: sgd
            weight_decay: 1e-4
            num_epochs: 3
          MACHINE:
            DEVICE: cpu
        """)
    cfg = compose([f"config={path}", "config.OPTIMIZER.num_epochs=5", "+config.MY_NOTE=hello"])
    assert cfg.OPTIMIZER.num_epochs == 5
    assert cfg.OPTIMIZER.weight_decay == pytest.approx(1e-4)  # yaml reads 1e-4 as a string: coerced to float
    assert cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA == 32
    assert cfg.MODEL.HEAD.PARAMS == [["mlp", {"dims": [512, 10]}]]
    assert cfg.MY_NOTE == "hello"
    assert cfg.CHECKPOINT.AUTO_RESUME is True  # untouched keys keep their defaults
    assert cfg.engine_name == "train"
    # the resolved config written into a run folder reads back to the same config
    plain = compose([f"config={path}", "config.OPTIMIZER.num_epochs=5"])
    again = write_yaml(tmp_path, "resolved.yaml", to_yaml(plain))
    assert compose([f"config={again}"]) == plain
    # ... and so does one with keys the run added with '+' (named on the file's '# added keys:' line)
    resolved = write_yaml(tmp_path, "resolved_added.yaml", to_yaml(cfg))
    assert "# added keys: config.MY_NOTE\n" in resolved.read_text()
    assert compose([f"config={resolved}"]) == cfg


def test_a_yaml_file_declares_its_own_keys_in_its_header(tmp_path):
    body = "# @package _global_\n{header}config:\n  MY_PLUGIN:\n    SIZE: 4\n"
    declared = write_yaml(tmp_path, "declared.yaml", body.format(header="# added keys: config.MY_PLUGIN\n"))
    assert compose([f"config={declared}"]).MY_PLUGIN.SIZE == 4
    undeclared = write_yaml(tmp_path, "undeclared.yaml", body.format(header=""))
    with pytest.raises(ConfigError, match="unknown config key config.MY_PLUGIN"):
        compose([f"config={undeclared}"])


def test_the_reference_vissl_config_composes():
    cfg = compose(["config=pretrain/simclr/simclr_8node_resnet", "config.MACHINE.DEVICE=cpu"])
    assert cfg.LOSS.name == "simclr_info_nce_loss"


def test_unknown_key_names_the_closest_keys():
    with pytest.raises(ConfigError) as e:
        compose([QUICK, "config.OPTIMIZER.num_epoch=2"])
    msg = str(e.value)
    assert "unknown config key config.OPTIMIZER.num_epoch" in msg
    assert "closest: config.OPTIMIZER.num_epochs" in msg
    assert "+config.OPTIMIZER.num_epoch=" in msg  # how to add a key of one's own


def test_unknown_key_in_a_yaml_file_and_in_the_wrong_section(tmp_path):
    path = write_yaml(tmp_path, "wrong_section.yaml", """\
        # @package _global_
        config:
          DATA:
            BATCHSIZE_PER_REPLICA: 8
        """)
    with pytest.raises(ConfigError) as e:
        compose([f"config={path}"])
    assert "config.DATA.BATCHSIZE_PER_REPLICA" in str(e.value)
    assert "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA" in str(e.value)


def test_a_yaml_files_stray_keys_can_be_dropped_from_the_command_line(tmp_path):
    """A shipped VISSL yaml may carry keys VISSL never read (rotnet's METERS.accuracy_list):
    ``~config.KEY`` (hydra's deletion) drops them without editing the file; the error says so."""
    path = write_yaml(tmp_path, "stray.yaml", """\
        # @package _global_
        config:
          METERS:
            name: accuracy_list_meter
            accuracy_list:
              topk_values: [1]
          OPTIMIZER:
            num_epochs: 3
        """)
    with pytest.raises(ConfigError, match=r"drop it with ~config\.METERS\.accuracy_list on the command line"):
        compose([f"config={path}"])
    with pytest.raises(ConfigError, match=r"~ deletes one key of the config"):
        compose([f"config={path}", "~config"])  # hydra would drop the whole experiment
    cfg = compose([f"config={path}", "~config.METERS.accuracy_list"])
    assert cfg.METERS.name == "accuracy_list_meter" and "accuracy_list" not in cfg.METERS
    assert cfg.OPTIMIZER.num_epochs == 3
    # deleting a key the defaults have gives back its default
    assert compose([f"config={path}", "~config.METERS.accuracy_list", "~config.OPTIMIZER.num_epochs"]).OPTIMIZER.num_epochs == 90
    with pytest.raises(ConfigError, match=r"~config\.METERS\.nope deletes a key the config does not have"):
        compose([f"config={path}", "~config.METERS.nope"])
    with pytest.raises(ConfigError, match=r"holds \{'topk_values': \[1\]\}; use ~config\.METERS\.accuracy_list"):
        compose([f"config={path}", "~config.METERS.accuracy_list=3"])


def test_nearest_keys_prefers_siblings_then_same_leaf_elsewhere():
    known = ["config.A.alpha", "config.A.beta", "config.B.gamma", "config.C.gamma"]
    assert nearest_keys("config.A.alpah", known) == ["config.A.alpha"]
    assert nearest_keys("config.A.gamma", known) == ["config.B.gamma", "config.C.gamma"]
    assert nearest_keys("config.A.zzz", known) == []


@pytest.mark.parametrize(
    "override, expected",
    [
        ("config.OPTIMIZER.num_epochs=two", "config.OPTIMIZER.num_epochs='two' has the wrong type: expected int, got string"),
        ("config.OPTIMIZER.num_epochs=1.5", "expected int, got float"),
        ("config.TEST_MODEL=maybe", "config.TEST_MODEL='maybe' has the wrong type: expected bool"),
        ("config.DATA.TRAIN.DATA_SOURCES=digits", "expected list, got string"),
        ("config.OPTIMIZER=3", "config.OPTIMIZER=3 has the wrong type: expected mapping"),
        ("config.LOG_FREQUENCY=null", "config.LOG_FREQUENCY=null has the wrong type: expected int, got null"),
        ("config.OPTIMIZER.weight_decay=nan", "config.OPTIMIZER.weight_decay=nan is not a finite number"),
    ],
)
def test_wrong_types_name_key_value_and_expected_type(override, expected):
    with pytest.raises(ConfigError) as e:
        compose([QUICK, override])
    assert expected in str(e.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=-4", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=-4 is out of range"),
        ("config.OPTIMIZER.num_epochs=0", "config.OPTIMIZER.num_epochs=0 is out of range: expected an integer in 1..1000000"),
        # was a MemoryError traceback (or the OOM killer) while the phase list was built
        ("config.OPTIMIZER.num_epochs=99999999999999999999",
         "config.OPTIMIZER.num_epochs=99999999999999999999 is out of range: expected an integer in 1..1000000"),
        ("config.MACHINE.DEVICE=tpu", "config.MACHINE.DEVICE='tpu' is out of range: expected one of cpu, gpu"),
        ("config.LOG_FREQUENCY=0", "config.LOG_FREQUENCY=0 is out of range"),
        ("config.CHECKPOINT.DIR=", "config.CHECKPOINT.DIR='' is out of range: expected a folder path"),
        ("config.DISTRIBUTED.NUM_PROC_PER_NODE=0", "config.DISTRIBUTED.NUM_PROC_PER_NODE=0 is out of range"),
        # one process, no conversion asked for: still checked
        ("config.MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE=nccl",
         "config.MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE='nccl' is out of range: expected one of pytorch, apex"),
        # flush_secs <= 0 spun SummaryWriter's thread for the whole run; 0 iterations gave histograms at every one
        ("config.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=0",
         "config.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=0 is out of range: expected an integer > 0 (minutes)"),
        ("config.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=-1",
         "config.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=-1 is out of range"),
        ("config.HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS=0",
         "config.HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS=0 is out of range: expected an integer > 0"),
        # were read as 0 and 1: a one-iteration trace where none was asked for
        ("config.PROFILING.NUM_ITERATIONS=0",
         "config.PROFILING.NUM_ITERATIONS=0 is out of range: expected an integer >= 1 (the iterations recorded)"),
        ("config.PROFILING.START_ITERATION=-5",
         "config.PROFILING.START_ITERATION=-5 is out of range: expected an integer >= 0 (a train iteration)"),
        ("config.PROFILING.WARMUP_ITERATIONS=-1", "config.PROFILING.WARMUP_ITERATIONS=-1 is out of range"),
    ],
)
def test_out_of_range_values(override, expected):
    with pytest.raises(ConfigError) as e:
        compose([QUICK, override])
    assert expected in str(e.value)


def test_sync_bn_type_is_read_as_the_model_reads_it():
    assert compose([QUICK, "config.MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE=APEX"]).MODEL.SYNC_BN_CONFIG.SYNC_BN_TYPE == "APEX"


def test_plus_adds_a_key_but_not_one_that_exists(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = compose([QUICK, "+config.MY_SECTION.SIZE=3", "++config.OTHER=x"])
    assert cfg.MY_SECTION.SIZE == 3 and cfg.OTHER == "x"
    assert "config.MY_SECTION" in caplog.text
    with pytest.raises(ConfigError, match=r"\+config.LOG_FREQUENCY=\.\.\. adds a key that already exists"):
        compose([QUICK, "+config.LOG_FREQUENCY=3"])


def test_config_abs_path_and_missing_names(tmp_path):
    path = write_yaml(tmp_path, "mine.yaml", "# @package _global_\nconfig:\n  LOG_FREQUENCY: 7\n")
    assert compose([f"config={path}"]).LOG_FREQUENCY == 7
    with pytest.raises(ConfigError, match=r"config=quick/supervised_digit matches no file.*nearest: quick/supervised_digits"):
        compose(["config=quick/supervised_digit"])
    with pytest.raises(ConfigError, match=r"no such file; nearest in .*: mine\.yaml"):
        compose([f"config={tmp_path / 'mne.yaml'}"])
    with pytest.raises(ConfigError, match="config= is empty"):
        compose(["config="])


@pytest.mark.parametrize("body, expected", [
    ("", "is empty"),
    ("# @package _global_\n# nothing yet\n", "is empty"),
    ("# @package _global_\nconfig:\n", "its 'config:' section is empty"),
    ("# @package _global_\nhydra:\n  job:\n    name: x\n", "has no 'config:' section"),
])
def test_an_experiment_file_without_options_is_named(tmp_path, body, expected):
    path = tmp_path / "empty.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=rf"^config file {path}:? {expected}"):
        compose([f"config={path}"])


def test_an_experiment_file_that_only_picks_the_engine_composes(tmp_path):
    """The options may all come from the command line: a file with engine_name alone is valid."""
    path = tmp_path / "engine_only.yaml"
    path.write_text("# @package _global_\nengine_name: extract_features\n")
    cfg = compose([f"config={path}", "config.DATA.TEST.DATA_SOURCES=[synthetic]"])
    assert cfg.engine_name == "extract_features" and cfg.DATA.TEST.DATA_SOURCES == ["synthetic"]


def test_vissl_older_top_level_extract_switch_picks_the_engine(tmp_path, caplog):
    """VISSL's extract_resnet_8gpu.yaml carries a top-level 'extract_features: True': it composes
    unchanged and runs extraction, unless engine_name is given on the command line."""
    path = tmp_path / "extract_resnet_8gpu.yaml"
    path.write_text("# @package _global_\nextract_features: True\nconfig:\n  LOG_FREQUENCY: 3\n")
    with caplog.at_level(logging.WARNING, logger="ssl_engine.config.compose"):
        cfg = compose([f"config={path}"])
    assert cfg.engine_name == "extract_features" and cfg.LOG_FREQUENCY == 3
    assert "extract_features" not in cfg and "read as engine_name=extract_features" in caplog.text
    assert compose([f"config={path}", "engine_name=train"]).engine_name == "train"
    path.write_text("# @package _global_\nextract_features: False\nconfig:\n  LOG_FREQUENCY: 3\n")
    assert compose([f"config={path}"]).engine_name == "train"
    path.write_text("# @package _global_\nextract_features: maybe\nconfig:\n  LOG_FREQUENCY: 3\n")
    with pytest.raises(ConfigError, match="extract_features='maybe'.*must be true or false"):
        compose([f"config={path}"])


def test_the_tool_names_an_empty_experiment_file(tmp_path):
    from conftest import run_tool

    path = tmp_path / "empty.yaml"
    path.write_text("# @package _global_\n")
    proc = run_tool([f"config={path}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: config file {path} is empty (nothing but comments, if anything): "
                                                f"an experiment file puts its options under 'config:'"]


def test_config_naming_a_folder_says_so_and_lists_its_yaml_files(tmp_path):
    (tmp_path / "a.yaml").write_text("# @package _global_\nconfig:\n  LOG_FREQUENCY: 7\n")
    (tmp_path / "b.yml").write_text("")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=rf"^config={tmp_path} is a folder \({tmp_path}\), not a yaml file; "
                                          rf"name one of its yaml files: config={tmp_path}/a\.yaml, config={tmp_path}/b\.yml$"):
        compose([f"config={tmp_path}"])
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match=r"is a folder .*; it holds no yaml files$"):
        compose([f"config={tmp_path / 'none'}"])
    # a folder of the config search path lists experiment names, as config= takes them
    with pytest.raises(ConfigError, match=r"^config=quick is a folder .*configs/config/quick\), not a yaml file; "
                                          r"name one of its yaml files: .*config=quick/supervised_digits"):
        compose(["config=quick"])


def test_an_experiment_named_with_yml_in_the_config_folders(tmp_path, monkeypatch):
    """VISSL users also keep .yml files: one in a config folder is named, with the two ways to use it;
    a .yml name that is in no folder is looked up, and advised, as its .yaml name."""
    exp = tmp_path / "config" / "quick" / "exp.yml"
    exp.parent.mkdir(parents=True)
    exp.write_text("# @package _global_\nconfig:\n  LOG_FREQUENCY: 2\n")
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^config=quick/exp\.yml: {re.escape(str(exp))} ends in \.yml, and the "
                                          rf"config folders are searched for \.yaml files only; rename it to "
                                          rf"exp\.yaml, or give its path: config={re.escape(str(exp))}$"):
        compose(["config=quick/exp.yml"])
    monkeypatch.delenv("SSL_ENGINE_CONFIG_DIR")
    with pytest.raises(ConfigError, match=r"nearest: quick/simclr_digits.*holding config/quick/simclr_digit\.yaml\)$"):
        compose(["config=quick/simclr_digit.yml"])


def test_a_missing_overlay_names_the_search_path_and_ssl_engine_config_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("SSL_ENGINE_CONFIG_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"matches no file rn51\.yaml under .*; the search path is "
                                          r"\$SSL_ENGINE_CONFIG_DIR/config, \./configs/config, then the package's "
                                          r"configs/config; SSL_ENGINE_CONFIG_DIR is not set \(set it to a folder "
                                          r"holding config/feature_extraction/trunk_only/rn51\.yaml\)$"):
        compose([QUICK, "+config/feature_extraction/trunk_only=rn51"])
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))  # no config/ folder in it
    with pytest.raises(ConfigError, match=rf"SSL_ENGINE_CONFIG_DIR={tmp_path} was left out: it has no config/ folder$"):
        compose([QUICK, "+config/feature_extraction/trunk_only=rn51"])


def test_a_missing_defaults_entry_names_the_file_the_entry_and_where_it_was_searched(tmp_path, monkeypatch):
    path = write_yaml(tmp_path, "mine.yaml", """\
        # @package _global_
        defaults:
          - /config/quick/supervised_digit
          - _self_
        config:
          LOG_FREQUENCY: 7
        """)
    repo_configs = Path(__file__).resolve().parents[1] / "configs"
    with pytest.raises(ConfigError) as e:
        compose([f"config={path}"])
    assert str(e.value) == (
        f"config file {path}: its defaults: entry config/quick/supervised_digit matches no file "
        f"config/quick/supervised_digit.yaml under {repo_configs}; nearest in config/quick/: supervised_digits, simclr_digits "
        f"(entries are paths below these folders, e.g. /config/quick/simclr_digits)")
    # the same in a file of the search path, named by its place there
    (tmp_path / "config" / "mine").mkdir(parents=True)
    (tmp_path / "config" / "mine" / "exp.yaml").write_text(path.read_text())
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path}/config/mine/exp\.yaml: its defaults: entry "
                                          rf"config/quick/supervised_digit matches no file"):
        compose(["config=mine/exp"])


def test_compat_key_warns_once_naming_it(caplog):
    key = "config.DATA.TRAIN.COPY_TO_LOCAL_DISK"
    assert key in compat_keys()
    with caplog.at_level(logging.WARNING):
        compose([QUICK, f"{key}=true"])
    hits = [r for r in caplog.records if key in r.getMessage()]
    assert len(hits) == 1 and "not acted on" in hits[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        compose([QUICK])  # at its default: no warning
    assert key not in caplog.text


@pytest.mark.parametrize(
    "name, body, expected",
    [
        ("unclosed.yaml", "# @package _global_\nconfig:\n  DATA:\n    TRAIN: [digits\n  LOG_FREQUENCY: 3\n",
         r"malformed yaml in .*unclosed\.yaml:5: .*\(while parsing a flow sequence at line 4\)"),
        ("tab.yaml", "# @package _global_\nconfig:\n\tLOG_FREQUENCY: 3\n", r"malformed yaml in .*tab\.yaml:3"),
        ("dup.yaml", "# @package _global_\nconfig:\n  LOG_FREQUENCY: 3\n  LOG_FREQUENCY: 4\n",
         r"dup\.yaml:4: duplicate key 'LOG_FREQUENCY' \(first set at line 3\)"),
        ("list.yaml", "- 1\n- 2\n", r"list\.yaml holds a list, not a mapping"),
        ("toplevel.yaml", "# @package _global_\nLOG_FREQUENCY: 3\n",
         r"unknown top-level key 'LOG_FREQUENCY'.*did you mean config\.LOG_FREQUENCY"),
        ("noheader.yaml", "config:\n  LOG_FREQUENCY: 3\n", r"noheader\.yaml lacks the header line '# @package _global_'"),
        ("tag.yaml", "# @package _global_\nconfig:\n  LOG_FREQUENCY: !custom 3\n", r"tag\.yaml:3: unknown yaml tag !custom"),
    ],
)
def test_malformed_yaml_names_file_and_line(tmp_path, name, body, expected):
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(ConfigError, match=expected):
        compose([f"config={path}"])


def test_yaml_python_tags_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(
        "# @package _global_\nconfig:\n"
        f"  LOG_FREQUENCY: !!python/object/apply:os.system ['touch {marker}']\n"
    )
    with pytest.raises(ConfigError, match=r"evil\.yaml:3: refused the tag !!python/object/apply:os\.system"):
        compose([f"config={path}"])
    assert not marker.exists()


def test_values_are_never_evaluated(tmp_path):
    marker = tmp_path / "ran"
    code = f"__import__('os').system('touch {marker}')"
    cfg = compose([QUICK, f"config.CHECKPOINT.DIR=\"{code}\""])
    assert cfg.CHECKPOINT.DIR == code  # kept as text
    assert not marker.exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("config.OPTIMIZER.num_epochs", "is not of the form key=value"),
        ("config.MODEL.HEAD.PARAMS=[[mlp,", "override 'config.MODEL.HEAD.PARAMS=[[mlp,' cannot be parsed"),
        ("config x=1", "has an invalid key"),
        ("=3", "has an invalid key"),
        # VISSL's group overlay without its '+'
        ("config/pretrain/swav/models=resnet18", "override 'config/pretrain/swav/models=resnet18' names a config group "
         "file without its '+': write +config/pretrain/swav/models=resnet18"),
        # json-style quoted mapping keys: hydra takes them unquoted (it was blamed on shell quoting)
        ('config.MODEL.HEAD.PARAMS=[["mlp",{"dims":[512,10]}]]', "cannot be parsed: hydra takes the keys of a mapping "
         'unquoted ({dims: ...}, not {"dims": ...})'),
        ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,10], 'use_bn': true}]]", "hydra takes the keys of a mapping "
         "unquoted ({use_bn: ...}, not {'use_bn': ...})"),
    ],
)
def test_overrides_that_are_not_key_value(override, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        compose([QUICK, override])

@pytest.mark.parametrize(
    "value",
    ["/data/ünï", 'a"ü', "it's ü", "C:\\ü\\", 'x\\"ü', "[/data/ünï,b\"ü]"],
)
def test_the_quoting_advice_for_a_non_ascii_value_is_a_shell_word_hydra_reads_back_as_the_value(value):
    """The advice for a value hydra takes only quoted must itself work: pasted into a shell it is
    one word, and hydra reads that word back as the value the user meant, whatever quotes or
    backslashes the value holds."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    with pytest.raises(ConfigError, match="only quoted") as e:
        compose([QUICK, f"config.CHECKPOINT.DIR={value}"])
    advice = str(e.value).split("inside the shell word: ", 1)[1]
    words = shlex.split(advice)
    assert len(words) == 1, advice
    parsed = OverridesParser.create().parse_override(words[0]).value()
    if value.startswith("["):
        assert parsed == [v for v in value[1:-1].split(",")]
    else:
        assert parsed == value



def test_a_config_of_a_vissl_method_not_implemented_says_so_before_its_unknown_keys(tmp_path):
    """VISSL's DINO config names dino_head / dino_loss and keys of a newer VISSL: the line says
    first that the method does not run here (the keys' advice, to drop them, would otherwise be
    all the user hears, and would change the method once its parts are registered)."""
    config = tmp_path / "dino_like.yaml"
    config.write_text(textwrap.dedent("""\
        # @package _global_
        config:
          LOSS:
            name: dino_loss
          MODEL:
            HEAD:
              PARAMS: [[dino_head, {in_dim: 2048}]]
          OPTIMIZER:
            param_group_constructor: dino
    """))
    with pytest.raises(ConfigError) as e:
        compose([f"config={config}"])
    assert str(e.value).startswith(
        "this config names 2 of VISSL's parts that ssl_engine does not implement: head 'dino_head' "
        "(config.MODEL.HEAD.PARAMS[0][0]), loss 'dino_loss' (config.LOSS.name); it runs only once modules in "
        "config.USER_MODULES register them. Its keys as well: unknown config key config.OPTIMIZER.param_group_constructor")
    module = tmp_path / "dino_parts.py"
    module.write_text("")
    with pytest.raises(ConfigError) as e:  # a user module may register them: only the keys are told
        compose([f"config={config}", f"config.USER_MODULES=[{module}]"])
    assert str(e.value).startswith("unknown config key config.OPTIMIZER.param_group_constructor")
    # an FSDP variant counts when the part it shards is missing too; one of an implemented part
    # (self_supervision_fsdp_task) is a rename, which the registry check tells once the keys are fixed
    config.write_text(config.read_text().replace("dino_head", "dino_head_fsdp")
                      + "  TRAINER:\n    TASK_NAME: self_supervision_fsdp_task\n")
    with pytest.raises(ConfigError) as e:
        compose([f"config={config}"])
    assert str(e.value).startswith(
        "this config names 2 of VISSL's parts that ssl_engine does not implement: head 'dino_head_fsdp' "
        "(config.MODEL.HEAD.PARAMS[0][0]; VISSL's FSDP variant of 'dino_head'), loss 'dino_loss' (config.LOSS.name); ")


def test_a_config_given_by_its_path_finds_its_overlays_in_its_own_config_tree(tmp_path, monkeypatch):
    """A VISSL user's repo: config=/repo/configs/config/pretrain/x/main.yaml with
    +config/pretrain/x/models=small finds models/small.yaml beside it, without
    SSL_ENGINE_CONFIG_DIR (it was 'matches no file' with the advice to set it)."""
    tree = tmp_path / "repo" / "configs" / "config" / "pretrain" / "x"
    (tree / "models").mkdir(parents=True)
    (tree / "main.yaml").write_text(textwrap.dedent("""\
        # @package _global_
        config:
          DATA:
            TRAIN:
              DATA_SOURCES: [digits]
              LABEL_SOURCES: [digits]
          MODEL:
            TRUNK:
              NAME: resnet
    """))
    (tree / "models" / "small.yaml").write_text(textwrap.dedent("""\
        # @package _global_
        config:
          MODEL:
            TRUNK:
              RESNETS:
                DEPTH: 18
    """))
    monkeypatch.delenv("SSL_ENGINE_CONFIG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = compose([f"config={tree / 'main.yaml'}", "+config/pretrain/x/models=small"], warn_unused=False)
    assert cfg.MODEL.TRUNK.RESNETS.DEPTH == 18
    with pytest.raises(ConfigError, match=r"\+config/pretrain/x/models=big matches no file big.yaml under .*"
                                          r"repo/configs/config/pretrain/x/models.*options there: small"):
        compose([f"config={tree / 'main.yaml'}", "+config/pretrain/x/models=big"])


def test_worker_wrapped_errors_unwrap_to_the_original_line():
    wrapped = (
        "rank 1: Caught UserError in DataLoader worker process 0.\n"
        "Original Traceback (most recent call last):\n"
        '  File "dataset.py", line 3, in _load\n'
        "    raise UserError(\n"
        "ssl_engine.errors.UserError: TRAIN image '/d/a: b.png' cannot be read; set ON_CORRUPT_IMAGE=skip\n"
    )
    assert unwrap_worker_error(wrapped) == "rank 1: TRAIN image '/d/a: b.png' cannot be read; set ON_CORRUPT_IMAGE=skip\n"
    assert one_line(wrapped) == "rank 1: TRAIN image '/d/a: b.png' cannot be read; set ON_CORRUPT_IMAGE=skip"
    assert one_line("plain\n  text") == "plain text"


# ----------------------------------------------------------------------------- startup cost


def test_defaults_are_read_as_omegaconf_reads_them(tmp_path):
    """defaults.yaml is read with libyaml (fast) but must give exactly what OmegaConf.load gives."""
    from omegaconf import OmegaConf

    from ssl_engine.config.compose import DEFAULTS_FILE, read_defaults_file

    tricky = write_yaml(tmp_path, "tricky.yaml", """\
    a: 1e-5
    b: 1e-08
    c: -2.5E+3
    d: .inf
    e: 2021-01-01
    f: 0x1F
    g: yes
    h: 'quoted'
    i: [1, 2.0, null, ~, true]
    j: {k: 07, l: 1_000}
    m: 12:30:45
    """)
    for path in (DEFAULTS_FILE, tricky):
        assert read_defaults_file(path) == OmegaConf.to_container(OmegaConf.load(path), resolve=True), path
    dup = write_yaml(tmp_path, "dup.yaml", "a: 1\na: 2\n")
    with pytest.raises(Exception, match="duplicate key"):
        read_defaults_file(dup)


def test_composing_and_config_errors_never_import_torch():
    """Config mistakes are reported before the seconds torch's import takes."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ssl_engine.config import compose\n"
        "compose(['config=quick/simclr_synthetic'])\n"
        "from ssl_engine.cli import main\n"
        "assert main(['config=quick/simclr_synthetic', 'config.OPTIMIZER.num_epoch=1']) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[1]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown config key config.OPTIMIZER.num_epoch")


def _run_without_torch(code: str) -> "subprocess.CompletedProcess[str]":
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(Path(__file__).resolve().parents[1]),
                          capture_output=True, text=True, timeout=180)


def test_forked_compose_gives_the_same_config_and_its_callback_runs_before_the_result():
    """The tool's process composes in a forked child while it imports torch: the config that
    comes back equals an in-process compose, the callback (the CLI starts the forkserver there)
    gets it from the watcher thread, and the child is reaped."""
    proc = _run_without_torch("""
        import os, threading
        from ssl_engine.config import compose, forked_compose
        overrides = ['config=quick/simclr_synthetic', 'config.OPTIMIZER.num_epochs=3']
        seen = []
        pending = forked_compose.start(overrides, on_config=lambda c: seen.append((c, threading.current_thread().name)))
        assert pending is not None, 'no child was forked'
        child = pending._pid
        import torch  # what the parent does meanwhile
        cfg = pending.result()
        assert cfg == compose(overrides) and cfg.OPTIMIZER.num_epochs == 3
        assert type(cfg).__name__ == 'AttrDict' and cfg.OPTIMIZER.num_epochs == cfg['OPTIMIZER']['num_epochs']
        assert len(seen) == 1 and seen[0][0] == cfg and seen[0][1] == 'ssl_engine-compose', seen
        try:
            os.waitpid(child, os.WNOHANG)
            raise AssertionError('the compose child was not reaped')
        except ChildProcessError:
            pass
        assert forked_compose.start(overrides) is None, 'torch is imported: nothing to overlap, no child'
        print('ok')
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_forked_compose_reports_config_errors_and_recomposes_what_the_child_could_not():
    proc = _run_without_torch("""
        import os
        from ssl_engine.config import forked_compose
        from ssl_engine.errors import UserError
        bad = ['config=quick/simclr_synthetic', 'config.OPTIMIZER.num_epoch=1']
        pending = forked_compose.start(bad, on_config=lambda c: print('callback ran'))
        try:
            pending.result()
            raise AssertionError('no error')
        except UserError as e:
            assert str(e).startswith('unknown config key config.OPTIMIZER.num_epoch'), e
        # a child that dies before answering (here: its compose is a bug) leaves the work to the
        # parent, which composes itself and so shows the real error, or the config
        parent = os.getpid()
        real = forked_compose._compose
        def compose_failing_in_the_child(overrides):
            if os.getpid() != parent:
                raise RuntimeError('child failed')
            return real(overrides)
        forked_compose._compose = compose_failing_in_the_child
        calls = []
        cfg = forked_compose.start(['config=quick/simclr_synthetic'], on_config=calls.append).result()
        assert cfg.OPTIMIZER.name == 'sgd' and calls == [cfg]
        # a parent that leaves before asking (its imports failed) stops and reaps the child, whose
        # answer then acts on nothing (here: a config error would have ended the process)
        forked_compose._compose = real
        pending = forked_compose.start(bad, exit_on_user_error=True)
        pending.cancel()
        try:
            os.waitpid(pending._pid, os.WNOHANG)
            raise AssertionError('the cancelled child was not reaped')
        except ChildProcessError:
            pass
        # a child cancelled while composing (Ctrl-C in the first half second) leaves no scratch
        # folder in the temp folder
        import glob, tempfile, time
        from ssl_engine.config import compose as compose_module
        def slow_hydra(*args, **kwargs):
            time.sleep(60)
        compose_module._hydra_compose = slow_hydra  # the forked child inherits it
        pending = forked_compose.start(['config=quick/simclr_synthetic'])
        pattern = os.path.join(tempfile.gettempdir(), forked_compose.scratch_folder_prefix(pending._pid) + '*')
        deadline = time.time() + 60
        while not glob.glob(pattern) and time.time() < deadline:
            time.sleep(0.01)
        assert glob.glob(pattern), 'the child made no scratch folder'
        pending.cancel()
        assert not glob.glob(pattern), glob.glob(pattern)
        print('ok')
    """)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines() == ["ok"], (proc.stdout, proc.stderr[-2000:])


def test_compose_removes_scratch_folders_of_killed_composing_processes(tmp_path, monkeypatch):
    """A process killed with SIGKILL while composing cannot remove its scratch folder from the
    temp folder; a later compose does, once the folder is old and its pid gone. A young folder,
    a running process's and one of another naming are kept."""
    import os
    import subprocess
    import sys
    import tempfile
    import time

    from ssl_engine.config import compose
    from ssl_engine.config.forked_compose import scratch_folder_prefix

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    old = time.time() - 3600
    folders = {
        "dead_old": tmp_path / f"{scratch_folder_prefix(gone.pid)}abc",
        "dead_young": tmp_path / f"{scratch_folder_prefix(gone.pid)}def",
        "alive_old": tmp_path / f"{scratch_folder_prefix(os.getpid())}ghi",
        "other": tmp_path / "ssl_engine_cfg_x8i0cf_r",
    }
    for name, folder in folders.items():
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "f.yaml").write_text("a: 1\n")
        if name != "dead_young":
            os.utime(folder, (old, old))
    compose(["config=quick/simclr_synthetic"])
    assert {name: folder.exists() for name, folder in folders.items()} == {
        "dead_old": False, "dead_young": True, "alive_old": True, "other": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for n, f in folders.items() if n != "dead_old")


def test_forked_compose_logs_each_compose_warning_once():
    """The child's compose warnings reach the console once, through the parent; when the parent
    composes again itself (the child failed), only the parent's own warnings are shown."""
    proc = _run_without_torch("""
        import os
        from ssl_engine.config import forked_compose
        from ssl_engine.errors import UserError
        from ssl_engine.logger import setup_logging
        setup_logging(0, None)
        warns = ['config=quick/simclr_synthetic', 'config.MONITOR_PERF_STATS=true']  # VISSL's older layout: a warning
        print('config', forked_compose.start(warns).result().HOOKS.PERF_STATS.MONITOR_PERF_STATS, flush=True)
        try:
            forked_compose.start(warns + ['config.LOG_FREQUENCY=0']).result()  # found after the warning
        except UserError:
            print('user error', flush=True)
        parent, real = os.getpid(), forked_compose._compose
        def compose_then_fail_in_the_child(overrides):
            cfg = real(overrides)  # its warnings are logged here
            if os.getpid() != parent:
                raise RuntimeError('child failed after composing')
            return cfg
        forked_compose._compose = compose_then_fail_in_the_child
        print('retry', forked_compose.start(warns).result().HOOKS.PERF_STATS.MONITOR_PERF_STATS, flush=True)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = [line for line in proc.stdout.splitlines() if "MONITOR_PERF_STATS is VISSL's older layout" in line or
           line in ("config True", "user error", "retry True")]
    warning = "config.MONITOR_PERF_STATS is VISSL's older layout; read as config.HOOKS.PERF_STATS.MONITOR_PERF_STATS"
    assert [line if line in ("config True", "user error", "retry True") else warning for line in out] == [
        warning, "config True", warning, "user error", warning, "retry True"], proc.stdout


def test_the_tool_pauses_the_garbage_collector_while_it_imports():
    """The tool's process runs no collection while it imports torch and the built-in parts, then
    freezes what it imported and switches the collector back on before the run; a library call
    leaves the collector as it was; an error before the imports are done still switches it back."""
    proc = _run_without_torch("""
        import gc, sys
        from ssl_engine.cli import run_command
        from ssl_engine.errors import UserError
        starts = []
        gc.callbacks.append(lambda phase, info: starts.append(info['generation']) if phase == 'start' else None)
        seen = {}
        def body(cfg, node_id):
            seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count(), torch='torch' in sys.modules,
                        collections=len(starts))
            return 0
        assert run_command(['config=quick/simclr_synthetic'], body, tool_process=True) == 0
        assert seen['torch'] and seen['enabled'], seen
        assert seen['collections'] == 0, f"{seen['collections']} collections while importing"
        assert seen['frozen'] > 100000, f"only {seen['frozen']} objects frozen"
        gc.collect()
        assert len(starts) == 1 and gc.get_freeze_count() == seen['frozen'], 'the frozen objects stay frozen'
        # an error raised before the imports are done (an unknown loss, found after the imports)
        gc.unfreeze()
        bad = ['config=quick/simclr_synthetic', 'config.LOSS.name=no_such_loss']
        assert run_command(bad, body, tool_process=True) == 2
        assert gc.isenabled() and gc.get_freeze_count() > 100000
        print('ok')
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    proc = _run_without_torch("""
        import gc, sys
        frozen_at_start = gc.get_freeze_count()  # Python 3.12 starts with a few hundred of its own
        from ssl_engine.cli import run_command
        starts = []
        gc.callbacks.append(lambda phase, info: starts.append(info['generation']) if phase == 'start' else None)
        seen = {}
        def body(cfg, node_id):
            seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count(), collections=len(starts))
            return 0
        assert run_command(['config=quick/simclr_synthetic'], body) == 0
        assert seen['enabled'] and seen['frozen'] == frozen_at_start and seen['collections'] > 0, seen
        gc.disable()
        assert run_command(['config=quick/simclr_synthetic'], body, tool_process=True) == 0
        assert not seen['enabled'] and not gc.isenabled(), 'a collector that was off stays off'
        print('ok')
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_tool_reports_a_config_mistake_without_waiting_for_torch(tmp_path):
    """Through the tool (composing in a child while the process imports torch), a config
    mistake is one line and exit code 2, and the process ends from the watcher thread as soon
    as the child reports it (os._exit: no atexit handler runs), not once torch has imported."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        import atexit, os, sys
        sys.path.insert(0, {str(repo)!r})
        sys.argv = ['run_distributed_engines.py', 'config=quick/simclr_synthetic', 'config.OPTIMIZER.num_epoch=1',
                    'config.CHECKPOINT.DIR={tmp_path / "run"}']
        atexit.register(lambda: print('normal interpreter exit', file=sys.stderr))
        from ssl_engine.cli import main
        sys.exit(main(sys.argv[1:], tool_process=True))
    """))
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: unknown config key config.OPTIMIZER.num_epoch (closest: config.OPTIMIZER.num_epochs); "
                     "to add a key of your own use +config.OPTIMIZER.num_epoch=..."], proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_vissl_older_hook_keys_are_read_at_their_016_place(tmp_path, caplog):
    """VISSL's older layout kept the perf-stats, TensorBoard and model-complexity options at the
    top level (and under MODEL); they are read under HOOKS, one warning each, and the hooks see
    them. A typo there is still an unknown key."""
    path = write_yaml(tmp_path, "older.yaml", """\
        # @package _global_
        config:
          MONITOR_PERF_STATS: True
          PERF_STAT_FREQUENCY: 40
          ROLLING_BTIME_FREQ: 313
          TENSORBOARD_SETUP:
            USE_TENSORBOARD: True
            FLUSH_EVERY_N_MIN: 2
          MODEL:
            MODEL_COMPLEXITY:
              COMPUTE_COMPLEXITY: True
              INPUT_SHAPE: [3, 32, 32]
        """)
    with caplog.at_level(logging.WARNING):
        cfg = compose([f"config={path}"])
    defaults = compose([])
    perf = cfg.HOOKS.PERF_STATS
    assert (perf.MONITOR_PERF_STATS, perf.PERF_STAT_FREQUENCY, perf.ROLLING_BTIME_FREQ) == (True, 40, 313)
    tb = cfg.HOOKS.TENSORBOARD_SETUP
    assert tb.USE_TENSORBOARD is True and tb.FLUSH_EVERY_N_MIN == 2
    assert tb.LOG_PARAMS_EVERY_N_ITERS == defaults.HOOKS.TENSORBOARD_SETUP.LOG_PARAMS_EVERY_N_ITERS  # the rest kept
    assert cfg.HOOKS.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY is True and cfg.HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE == [3, 32, 32]
    for old in ("MONITOR_PERF_STATS", "TENSORBOARD_SETUP", "MODEL_COMPLEXITY"):
        assert old not in cfg and old not in cfg.MODEL
    for old, new in [("config.MONITOR_PERF_STATS", "config.HOOKS.PERF_STATS.MONITOR_PERF_STATS"),
                     ("config.TENSORBOARD_SETUP", "config.HOOKS.TENSORBOARD_SETUP"),
                     ("config.MODEL.MODEL_COMPLEXITY", "config.HOOKS.MODEL_COMPLEXITY")]:
        assert f"{old} is VISSL's older layout; read as {new}" in caplog.text
    typo = write_yaml(tmp_path, "typo.yaml", "# @package _global_\nconfig:\n  TENSORBOARD_SETUP:\n    USE_TENSORBORD: true\n")
    with pytest.raises(ConfigError, match=r"config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBORD"):
        compose([f"config={typo}"])


@pytest.mark.parametrize("override, old, new, value", [
    ("config.MONITOR_PERF_STATS=true", "config.MONITOR_PERF_STATS", "config.HOOKS.PERF_STATS.MONITOR_PERF_STATS", True),
    ("config.PERF_STAT_FREQUENCY=40", "config.PERF_STAT_FREQUENCY", "config.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY", 40),
    ("config.ROLLING_BTIME_FREQ=313", "config.ROLLING_BTIME_FREQ", "config.HOOKS.PERF_STATS.ROLLING_BTIME_FREQ", 313),
    ("config.TENSORBOARD_SETUP.USE_TENSORBOARD=true", "config.TENSORBOARD_SETUP",
     "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD", True),
    ("config.MODEL.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY=true", "config.MODEL.MODEL_COMPLEXITY",
     "config.HOOKS.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY", True),
    ("config.MODEL.TRUNK.TRUNK_PARAMS.RESNETS.DEPTH=50", "config.MODEL.TRUNK.TRUNK_PARAMS",
     "config.MODEL.TRUNK.RESNETS.DEPTH", 50),
    ("config.MODEL.TRUNK.TRUNK_PARAMS={RESNETS:{DEPTH:34}}", "config.MODEL.TRUNK.TRUNK_PARAMS",
     "config.MODEL.TRUNK.RESNETS.DEPTH", 34),
    ("config.MACHINE.NUM_DATALOADER_WORKERS=3", "config.MACHINE.NUM_DATALOADER_WORKERS",
     "config.DATA.NUM_DATALOADER_WORKERS", 3),
])
def test_vissl_older_keys_as_overrides_are_read_at_their_016_place(override, old, new, value, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = compose([QUICK, override])
    node = cfg
    for part in new.split(".")[1:]:
        node = node[part]
    assert node == value
    assert f"{old} is VISSL's older layout; read as config." in caplog.text  # the warning a yaml file's key gives


def test_the_pre_release_loss_section_is_refused_with_where_it_goes_and_no_drop_advice(tmp_path):
    """config.CRITERION (VISSL's pre-release name of the loss section, upper-case option keys) is
    not moved: the error says where the loss goes, and does not offer ~config.CRITERION, which
    would train the default loss (CrossEntropyLoss) without a word."""
    path = write_yaml(tmp_path, "old_simclr.yaml", """\
        # @package _global_
        config:
          MACHINE:
            NUM_DATALOADER_WORKERS: 0
          CRITERION:
            name: simclr_info_nce_loss
            SIMCLR_INFO_NCE_LOSS:
              TEMPERATURE: 0.1
          OPTIMIZER:
            momentm: 0.9
        """)
    with pytest.raises(ConfigError) as info:
        compose([f"config={path}"])
    message = str(info.value)
    assert "config.CRITERION is the loss section of VISSL's pre-release layout" in message
    assert "config.LOSS" in message and "CrossEntropyLoss" in message
    assert "~config.CRITERION" not in message
    assert "~config.OPTIMIZER.momentm" in message  # a plain unknown key may still be dropped
    assert "NUM_DATALOADER_WORKERS" not in message  # the older worker key is read at DATA's place


def test_the_pre_release_feature_evaluation_is_refused_with_where_it_goes_and_no_drop_advice(tmp_path):
    """VISSL's pre-release linear evaluation (MODEL.FEATURE_EVAL_MODE, EVAL_FEATURES,
    TRUNK.LINEAR_FEAT_POOL_OPS, PARAMS_FILE.PATH; its other_styles/eval_resnet_final_output file):
    the error says where each goes in 0.1.6 and does not offer to drop them with ~, which would
    train the whole model from its random init instead of evaluating the pretrained trunk."""
    path = write_yaml(tmp_path, "old_linear.yaml", """\
        # @package _global_
        config:
          MODEL:
            FEATURE_EVAL_MODE: True
            EVAL_FEATURES: ["res5avg"]
            TRUNK:
              LINEAR_FEAT_POOL_OPS: [["Identity", []]]
            PARAMS_FILE:
              PATH: /models/rn50.torch
              STATE_DICT_KEY_NAME: classy_state_dict
          OPTIMIZER:
            momentm: 0.9
        """)
    with pytest.raises(ConfigError) as info:
        compose([f"config={path}"])
    message = str(info.value)
    for key, goes in [("config.MODEL.FEATURE_EVAL_MODE", "config.MODEL.FEATURE_EVAL_SETTINGS"),
                      ("config.MODEL.EVAL_FEATURES", "LINEAR_EVAL_FEAT_POOL_OPS_MAP"),
                      ("config.MODEL.TRUNK.LINEAR_FEAT_POOL_OPS", "LINEAR_EVAL_FEAT_POOL_OPS_MAP"),
                      ("config.MODEL.PARAMS_FILE", "config.MODEL.WEIGHTS_INIT.PARAMS_FILE")]:
        assert f"{key} is " in message and "pre-release layout" in message and goes in message, key
        assert f"~{key}" not in message
    assert "~config.OPTIMIZER.momentm" in message  # a plain unknown key may still be dropped


def test_an_older_key_override_wins_over_the_same_key_in_the_file(tmp_path, caplog):
    path = write_yaml(tmp_path, "older.yaml", "# @package _global_\nconfig:\n  PERF_STAT_FREQUENCY: 40\n")
    cfg = compose([f"config={path}", "config.PERF_STAT_FREQUENCY=7"])
    assert cfg.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY == 7
    with pytest.raises(ConfigError, match=r"config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBORD \(closest: "
                                          r"config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD\)"):
        compose([QUICK, "config.TENSORBOARD_SETUP.USE_TENSORBORD=true"])


def test_a_new_layout_override_wins_over_the_files_older_layout(tmp_path):
    """The file says MONITOR_PERF_STATS / TRUNK_PARAMS (moved onto the new place); the command
    line sets the new place itself: the command line wins, as it does for any other key."""
    path = write_yaml(tmp_path, "older.yaml", "# @package _global_\nconfig:\n  MONITOR_PERF_STATS: true\n"
                                              "  TENSORBOARD_SETUP:\n    USE_TENSORBOARD: true\n    FLUSH_EVERY_N_MIN: 7\n"
                                              "  MODEL:\n    TRUNK:\n      TRUNK_PARAMS:\n        RESNETS:\n"
                                              "          DEPTH: 18\n")
    cfg = compose([f"config={path}"])
    assert cfg.HOOKS.PERF_STATS.MONITOR_PERF_STATS is True and cfg.MODEL.TRUNK.RESNETS.DEPTH == 18
    cfg = compose([f"config={path}", "config.HOOKS.PERF_STATS.MONITOR_PERF_STATS=false",
                   "config.MODEL.TRUNK.RESNETS.DEPTH=50", "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=false"])
    assert cfg.HOOKS.PERF_STATS.MONITOR_PERF_STATS is False and cfg.MODEL.TRUNK.RESNETS.DEPTH == 50
    assert cfg.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD is False
    assert cfg.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN == 7  # the file's other moved values stay


def test_vissl_config_shapes_read_as_vissl_does(tmp_path, caplog):
    path = write_yaml(tmp_path, "vissl_shapes.yaml", """\
        # @package _global_
        config:
          METERS:
          DATA:
            TRAIN:
              DATA_PATHS: null
              TRANSFORMS:
          MODEL:
            TRUNK:
              NAME: resnet
              TRUNK_PARAMS:
                RESNETS:
                  DEPTH: 101
              VISION_TRANSFORMERS:
                DROP_PATH_RATE: 0.1
                QK_SCALE: 0.125
            AMP_PARAMS:
              AMP_ARGS: {"opt_level": "O3", "keep_batchnorm_fp32": True, "loss_scale": "dynamic"}
        """)
    with caplog.at_level(logging.WARNING):
        cfg = compose([f"config={path}"])
    defaults = compose([QUICK])
    # an empty section keeps its defaults; an empty list is []
    assert cfg.METERS == compose([]).METERS and cfg.DATA.TRAIN.DATA_PATHS == [] and cfg.DATA.TRAIN.TRANSFORMS == []
    # VISSL's older TRUNK_PARAMS layout is read one level up, with a warning
    assert cfg.MODEL.TRUNK.RESNETS.DEPTH == 101 and "TRUNK_PARAMS" not in cfg.MODEL.TRUNK
    assert "TRUNK_PARAMS is VISSL's older layout" in caplog.text
    # [compat] keys keep any value a VISSL config gives them (they are not acted on)
    assert cfg.MODEL.TRUNK.VISION_TRANSFORMERS.QK_SCALE == 0.125
    assert cfg.MODEL.TRUNK.VISION_TRANSFORMERS.DROP_PATH_RATE == 0.1
    # AMP_ARGS are apex's arguments: any key
    assert cfg.MODEL.AMP_PARAMS.AMP_ARGS == {"opt_level": "O3", "keep_batchnorm_fp32": True, "loss_scale": "dynamic"}
    assert defaults.MODEL.AMP_PARAMS.AMP_ARGS == {"opt_level": "O1"}
    # a key of a section that is not [compat] still has its type checked
    with pytest.raises(ConfigError, match="config.OPTIMIZER.num_epochs='two' has the wrong type"):
        compose([QUICK, "config.OPTIMIZER.num_epochs=two"])


def test_a_key_in_the_wrong_section_names_where_it_belongs(tmp_path):
    # (TENSORBOARD_SETUP at the top is VISSL's older layout and is read under HOOKS: see above)
    path = write_yaml(tmp_path, "misplaced.yaml", "# @package _global_\nconfig:\n  CHECKPOINT_FREQUENCY: 2\n")
    with pytest.raises(ConfigError, match=r"unknown config key config.CHECKPOINT_FREQUENCY \(closest: config.CHECKPOINT.CHECKPOINT_FREQUENCY\)"):
        compose([f"config={path}"])
    with pytest.raises(ConfigError, match=r"config.DATA.BATCHSIZE_PER_REPLICA \(closest: config.DATA.TEST.BATCHSIZE_PER_REPLICA, "
                                          r"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA"):
        compose([QUICK, "config.DATA.BATCHSIZE_PER_REPLICA=3"])
    # an unknown name is reported at its exact key (split and position)
    from ssl_engine.engines.run import load_builtin_parts
    from ssl_engine.config.validate import check_registered_names

    load_builtin_parts()
    with pytest.raises(UserError, match=r"unknown transform 'ToTensr' \(config key config.DATA.TEST.TRANSFORMS\[1\].name\)"):
        check_registered_names(compose([QUICK, "config.DATA.TEST.TRANSFORMS=[{name: Resize, size: 8},{name: ToTensr}]"]))


def test_sections_of_other_vissl_tools_compose_and_the_warning_names_the_tool(tmp_path, caplog):
    # VISSL's SVM / low-shot configs carry a section its other tools read; the config still composes
    path = write_yaml(tmp_path, "svm.yaml", """\
        # @package _global_
        defaults:
          - /config/quick/simclr_synthetic
          - _self_
        config:
          SVM:
            cls_list: []
            costs:
              costs_list: [0.1, 1.0]
          REPRODUCIBILITY:
            CUDDN_DETERMINISTIC: true
        """)
    with caplog.at_level(logging.WARNING, logger="ssl_engine"):
        cfg = compose([f"config={path}"])
    assert cfg.SVM.costs.costs_list == [0.1, 1.0] and cfg.REPRODUCIBILITY.CUDDN_DETERMINISTIC is True
    warned = [r.getMessage() for r in caplog.records]
    assert any("config.SVM configures VISSL's SVM benchmark (tools/train_svm.py)" in w and "not acted on" in w
               for w in warned), warned
    assert any("config.REPRODUCIBILITY" in w for w in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ssl_engine"):
        assert compose([QUICK]).SVM == {}  # not set: no warning
    assert not [r for r in caplog.records if "SVM" in r.getMessage()]
    # a key of its own on the command line is added with '+', as anywhere
    assert compose([QUICK, "+config.SVM.cost=1"]).SVM.cost == 1


def test_vissl_overlay_of_a_config_group_file(tmp_path, monkeypatch):
    group = tmp_path / "config" / "feature_extraction" / "trunk_only"
    group.mkdir(parents=True)
    write_yaml(group, "rn50_layers.yaml", """\
        # @package _global_
        config:
          MODEL:
            FEATURE_EVAL_SETTINGS:
              EVAL_MODE_ON: True
              EXTRACT_TRUNK_FEATURES_ONLY: True
              LINEAR_EVAL_FEAT_POOL_OPS_MAP: [["res5", ["AdaptiveAvgPool2d", [[1, 1]]]]]
        """)
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))
    cfg = compose([QUICK, "+config/feature_extraction/trunk_only=rn50_layers"])
    fes = cfg.MODEL.FEATURE_EVAL_SETTINGS
    assert fes.EVAL_MODE_ON and fes.EXTRACT_TRUNK_FEATURES_ONLY
    assert fes.LINEAR_EVAL_FEAT_POOL_OPS_MAP == [["res5", ["AdaptiveAvgPool2d", [[1, 1]]]]]
    # command-line keys win over the overlay, which wins over the experiment
    cfg = compose([QUICK, "+config/feature_extraction/trunk_only=rn50_layers.yaml",
                   "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=false"])
    assert cfg.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON is False
    with pytest.raises(ConfigError, match=r"trunk_only=rn51 matches no file rn51\.yaml under .*; options there: rn50_layers"):
        compose([QUICK, "+config/feature_extraction/trunk_only=rn51"])


def test_a_config_group_file_wins_over_the_experiments_older_layout(tmp_path, monkeypatch):
    """VISSL's swav_8node_resnet.yaml says TRUNK_PARAMS.RESNETS.DEPTH: 50 (the older layout);
    its models/resnet18.yaml, merged over it, says RESNETS.DEPTH: 18 (the 0.1.6 place): the
    merged file wins, as later files do (and as in VISSL, which reads only the 0.1.6 place).
    A later older-layout value, from a file or the command line, wins over it in turn."""
    experiment = write_yaml(tmp_path, "swav_old.yaml", """\
        # @package _global_
        config:
          MODEL:
            TRUNK:
              NAME: resnet
              TRUNK_PARAMS:
                RESNETS:
                  DEPTH: 50
                  WIDTH_MULTIPLIER: 2
          TENSORBOARD_SETUP:
            FLUSH_EVERY_N_MIN: 3
        """)
    models = tmp_path / "config" / "pretrain" / "swav" / "models"
    models.mkdir(parents=True)
    write_yaml(models, "resnet18.yaml", """\
        # @package _global_
        config:
          MODEL:
            TRUNK:
              NAME: resnet
              RESNETS:
                DEPTH: 18
          HOOKS:
            TENSORBOARD_SETUP:
              FLUSH_EVERY_N_MIN: 9
        """)
    (tmp_path / "config" / "older").mkdir()
    write_yaml(tmp_path / "config" / "older", "older34.yaml", """\
        # @package _global_
        config:
          MODEL:
            TRUNK:
              TRUNK_PARAMS:
                RESNETS:
                  DEPTH: 34
        """)
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))
    cfg = compose([f"config={experiment}", "+config/pretrain/swav/models=resnet18"])
    assert cfg.MODEL.TRUNK.RESNETS.DEPTH == 18
    assert cfg.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER == 2  # what the group file does not set stays the experiment's
    assert cfg.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN == 9
    cfg = compose([f"config={experiment}", "+config/pretrain/swav/models=resnet18", "+config/older=older34"])
    assert cfg.MODEL.TRUNK.RESNETS.DEPTH == 34
    cfg = compose([f"config={experiment}", "+config/pretrain/swav/models=resnet18",
                   "config.MODEL.TRUNK.TRUNK_PARAMS.RESNETS.DEPTH=101", "config.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=5"])
    assert cfg.MODEL.TRUNK.RESNETS.DEPTH == 101 and cfg.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN == 5
    cfg = compose([f"config={experiment}", "+config/pretrain/swav/models=resnet18", "config.MODEL.TRUNK.RESNETS.DEPTH=152"])
    assert cfg.MODEL.TRUNK.RESNETS.DEPTH == 152


def test_a_file_that_inherits_a_vissl_experiment_wins_over_its_older_layout(tmp_path, monkeypatch):
    """A user's file lists VISSL's experiment (TRUNK_PARAMS.RESNETS.DEPTH: 50, top-level
    TENSORBOARD_SETUP) in its defaults and sets the new places itself: with _self_ last (hydra's
    default) the user's values win, as hydra merges them; the older layout no longer overrides
    them silently after composing (a ResNet-50 was built where the file asked for a ResNet-101).
    With _self_ first, or a later defaults entry in the older layout, the older value wins."""
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))
    vissl = tmp_path / "config" / "pretrain" / "simclr"
    vissl.mkdir(parents=True)
    write_yaml(vissl, "simclr_old.yaml", """\
        # @package _global_
        config:
          MODEL:
            TRUNK:
              NAME: resnet
              TRUNK_PARAMS:
                RESNETS:
                  DEPTH: 50
          TENSORBOARD_SETUP:
            USE_TENSORBOARD: true
        """)
    user = tmp_path / "config" / "user"
    user.mkdir()
    body = """\
        config:
          MODEL:
            TRUNK:
              RESNETS:
                DEPTH: 101
          HOOKS:
            TENSORBOARD_SETUP:
              USE_TENSORBOARD: false
        """
    body = textwrap.dedent(body)
    write_yaml(user, "mine.yaml", "# @package _global_\ndefaults:\n  - /config/pretrain/simclr/simclr_old\n  - _self_\n" + body)
    write_yaml(user, "implicit_self.yaml", "# @package _global_\ndefaults:\n  - /config/pretrain/simclr/simclr_old\n" + body)
    write_yaml(user, "self_first.yaml", "# @package _global_\ndefaults:\n  - _self_\n  - /config/pretrain/simclr/simclr_old\n" + body)
    write_yaml(user, "chain.yaml", "# @package _global_\ndefaults:\n  - /config/user/mine\n  - _self_\n"
                                   "config:\n  OPTIMIZER:\n    num_epochs: 3\n")
    for name in ("mine", "implicit_self", "chain"):
        cfg = compose([f"config=user/{name}"])
        assert (cfg.MODEL.TRUNK.RESNETS.DEPTH, cfg.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD) == (101, False), name
    cfg = compose(["config=user/self_first"])
    assert (cfg.MODEL.TRUNK.RESNETS.DEPTH, cfg.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD) == (50, True)
    # the command line wins over both, in either layout
    assert compose(["config=user/mine", "config.MODEL.TRUNK.TRUNK_PARAMS.RESNETS.DEPTH=34"]).MODEL.TRUNK.RESNETS.DEPTH == 34
    assert compose(["config=user/self_first", "config.MODEL.TRUNK.RESNETS.DEPTH=18"]).MODEL.TRUNK.RESNETS.DEPTH == 18
    # a user file given by path inherits the same way
    path = write_yaml(tmp_path, "by_path.yaml", "# @package _global_\ndefaults:\n  - /config/pretrain/simclr/simclr_old\n"
                                                "  - _self_\n" + body)
    assert compose([f"config={path}"]).MODEL.TRUNK.RESNETS.DEPTH == 101


def test_alias_bombs_recursive_aliases_and_deep_nesting_are_one_line(tmp_path):
    """A yaml 'billion laughs' file ran composing out of memory (a MemoryError traceback); an alias
    inside its own anchor and nesting deeper than the parser's recursion were tracebacks too."""
    laughs = "".join(f"  {chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
    bomb = write_yaml(tmp_path, "bomb.yaml", "# @package _global_\nconfig:\n  a: &a [lol, lol, lol, lol, lol, lol, lol, "
                                             "lol, lol]\n" + laughs)
    with pytest.raises(ConfigError, match=re.escape(f"config file {bomb}: its anchors and aliases (&name / *name) expand "
                                                    f"to more than 1,000,000 values")):
        compose([f"config={bomb}"])
    itself = write_yaml(tmp_path, "itself.yaml", "# @package _global_\nconfig:\n  A: &x [*x]\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {itself}: an alias (*name) stands inside its own anchor")):
        compose([f"config={itself}"])
    deep = write_yaml(tmp_path, "deep.yaml", "# @package _global_\nconfig:\n  X: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file {deep} nests its lists or mappings too deeply")):
        compose([f"config={deep}"])
    # anchors used as VISSL files use them (a few shared values) still compose
    shared = write_yaml(tmp_path, "shared.yaml", "# @package _global_\nconfig:\n  DATA:\n    TRAIN:\n      DATA_PATHS: &p "
                                                 "[/data/a]\n    TEST:\n      DATA_PATHS: *p\n")
    cfg = compose([f"config={shared}"])
    assert cfg.DATA.TRAIN.DATA_PATHS == cfg.DATA.TEST.DATA_PATHS == ["/data/a"]


def test_every_problem_of_a_file_is_named_at_once(tmp_path):
    path = write_yaml(tmp_path, "three_mistakes.yaml", """\
        # @package _global_
        config:
          OPTIMIZER:
            num_epochs: two
            num_epoch: 3
          LOG_FREQUENCY: ten
        """)
    with pytest.raises(ConfigError) as e:
        compose([f"config={path}"])
    msg = str(e.value)
    assert "unknown config key config.OPTIMIZER.num_epoch (closest: config.OPTIMIZER.num_epochs)" in msg
    assert "config.OPTIMIZER.num_epochs='two' has the wrong type" in msg
    assert "config.LOG_FREQUENCY='ten' has the wrong type" in msg


def test_a_wrong_key_or_value_names_the_file_of_the_defaults_chain_that_set_it(tmp_path, monkeypatch):
    """A typo or a wrong type in a file that the experiment inherits through its defaults list
    was reported without a file: the line names the file that set the key last (the user's own
    file by the path given); a key set on the command line names no file."""
    monkeypatch.setenv("SSL_ENGINE_CONFIG_DIR", str(tmp_path))
    user = tmp_path / "config" / "user"
    user.mkdir(parents=True)
    base = write_yaml(user, "base.yaml", """\
        # @package _global_
        defaults:
          - /config/quick/simclr_synthetic
          - _self_
        config:
          DATA:
            TRAIN:
              BATCHSIZE_PER_REPLCIA: 8
          OPTIMIZER:
            num_epochs: two
        """)
    child = write_yaml(tmp_path, "child.yaml", "# @package _global_\ndefaults:\n  - /config/user/base\n  - _self_\n"
                                                "config:\n  LOG_FREQUENCY: ten\n")
    with pytest.raises(ConfigError) as e:
        compose([f"config={child}"])
    msg = str(e.value)
    assert ("unknown config key config.DATA.TRAIN.BATCHSIZE_PER_REPLCIA (closest: "
            f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA), set in {base} (a key of a yaml file") in msg, msg
    assert f"config.OPTIMIZER.num_epochs='two' has the wrong type: expected int, got string, set in {base}" in msg, msg
    assert f"config.LOG_FREQUENCY='ten' has the wrong type: expected int, got string, set in {child}" in msg, msg
    with pytest.raises(ConfigError) as e:
        compose(["config=quick/simclr_synthetic", "config.OPTIMIZER.num_epochs=two"])
    assert "set in" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override", [
    "config.MODEL.TRUNK.RESNETS.LAYER4_STRIDE=1", "config.DATA.TRAIN.DATA_LIMIT_SAMPLING.SKIP_NUM_SAMPLES=4",
    "config.DATA.TRAIN.DATA_LIMIT_SAMPLING.IS_BALANCED=true", "config.DATA.TRAIN.MMAP_MODE=false",
    "config.DATA.TRAIN.REMOVE_IMG_PATH_PREFIX=/old", "config.DATA.TRAIN.NEW_IMG_PATH_PREFIX=/new",
    "config.PROFILING.STOP_TRAINING_AFTER_PROFILING=true", "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf",
])
def test_keys_the_engine_acts_on_are_not_called_unused(override, caplog):
    """A key the code reads is not [compat]: setting it must not log that it is not acted on."""
    with caplog.at_level(logging.WARNING):
        compose([QUICK, override])
    assert "not acted on" not in caplog.text, caplog.text


def test_a_misspelt_section_of_a_part_is_an_unknown_key_but_a_users_own_is_accepted(tmp_path):
    """LOSS, METERS and MODEL.TRUNK take sections of the user's own parts; a section whose name
    is a near miss of a built-in one (a typo, or VISSL's older ``accuracy_list``) would be left
    unused without a word, so it is an unknown key with the closest name."""
    for parent, section, closest in [
        ("LOSS", "simclr_info_nce_los", "config.LOSS.simclr_info_nce_loss"),
        ("METERS", "accuracy_list", "config.METERS.accuracy_list_meter"),
        ("MODEL.TRUNK", "RESNET", "config.MODEL.TRUNK.RESNETS"),
    ]:
        body = "config:\n"
        indent = "  "
        for part in parent.split("."):
            body += f"{indent}{part}:\n"
            indent += "  "
        body += f"{indent}{section}:\n{indent}  DEPTH: 18\n"
        path = write_yaml(tmp_path, f"typo_{section}.yaml", "# @package _global_\n" + body)
        with pytest.raises(ConfigError, match=rf"unknown config key config.{parent}.{section} \(closest: {closest}"):
            compose([f"config={path}"])
    own = write_yaml(tmp_path, "own.yaml", "# @package _global_\nconfig:\n  LOSS:\n    my_loss:\n      margin: 0.5\n")
    assert compose([f"config={own}"]).LOSS.my_loss == {"margin": 0.5}
    declared = write_yaml(tmp_path, "declared.yaml", "# @package _global_\n# added keys: config.LOSS.swav_los\n"
                                                     "config:\n  LOSS:\n    swav_los:\n      eps: 1\n")
    assert compose([f"config={declared}"]).LOSS.swav_los == {"eps": 1}


def test_vissl_values_for_input_type_and_an_infinity_norm_are_accepted():
    """VISSL's INPUT_TYPE values bgr and lab (its colorization configs) and the max norm for
    gradient clipping (NORM_TYPE: inf) compose; other values are still refused."""
    assert compose([QUICK, "config.MODEL.INPUT_TYPE=bgr"]).MODEL.INPUT_TYPE == "bgr"
    assert compose([QUICK, "config.MODEL.INPUT_TYPE=lab"]).MODEL.INPUT_TYPE == "lab"
    with pytest.raises(ConfigError, match="config.MODEL.INPUT_TYPE='cmyk'.*one of rgb, bgr"):
        compose([QUICK, "config.MODEL.INPUT_TYPE=cmyk"])
    assert compose([QUICK, "config.MODEL.GRAD_CLIP.NORM_TYPE=inf"]).MODEL.GRAD_CLIP.NORM_TYPE == float("inf")
    for key in ("config.MODEL.GRAD_CLIP.MAX_NORM", "config.OPTIMIZER.weight_decay"):
        with pytest.raises(ConfigError, match=f"{key}=.*not a finite number"):
            compose([QUICK, f"{key}=inf"])


def test_a_list_where_a_section_belongs_names_the_key(tmp_path):
    """hydra's own message for it (merging a list into a mapping) names no key."""
    path = write_yaml(tmp_path, "section_list.yaml", "# @package _global_\nconfig:\n  DATA:\n    TRAIN: [a, b]\n")
    with pytest.raises(ConfigError, match=r"section_list.yaml: config.DATA.TRAIN holds a list, but it is a section"):
        compose([f"config={path}"])


@pytest.mark.parametrize("text, override, must", [
    ("  MODEL:\n    HEAD:\n      PARAMS: {name: mlp, dims: [512, 64]}\n", None,
     "head_dict.yaml: config.MODEL.HEAD.PARAMS holds a mapping, but it is a list: write it as a list (PARAMS: [...]"),
    (None, "config.DATA.TRAIN.DATA_SOURCES={a: 1}",
     "config.DATA.TRAIN.DATA_SOURCES={a: 1} gives a mapping, but config.DATA.TRAIN.DATA_SOURCES is a list: write it "
     "as a list (config.DATA.TRAIN.DATA_SOURCES=[...])"),
    (None, "config.METERS.accuracy_list_meter.topk_values={a: 1}",
     "but config.METERS.accuracy_list_meter.topk_values is a list: write it as a list like its default [1]"),
    (None, "config.MACHINE=[cpu]",
     "config.MACHINE=[cpu] gives a list, but config.MACHINE is a section of options: set them one by one"),
])
def test_a_mapping_where_a_list_belongs_names_the_key(tmp_path, text, override, must):
    """hydra's message ("Cannot merge DictConfig with ListConfig") names the key only deep in its
    cause, and for a yaml file not at all."""
    args = [QUICK]
    if text is not None:
        args = [f"config={write_yaml(tmp_path, 'head_dict.yaml', '# @package _global_' + chr(10) + 'config:' + chr(10) + text)}"]
    if override is not None:
        args.append(override)
    with pytest.raises(ConfigError) as info:
        compose(args)
    assert must in str(info.value) and "Cannot merge" not in str(info.value), str(info.value)


def test_a_leading_tilde_is_the_home_folder_in_every_path_key(tmp_path):
    """CHECKPOINT.DIR: ~/runs/a in a yaml file is $HOME/runs/a for the whole run (checked, written,
    resumed), never a folder named '~' in the working directory; on the command line, where hydra's
    grammar does not take an unquoted ~, the error says how to write it."""
    import subprocess
    import sys

    from conftest import TOOL, tool_env

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent("""\
        # @package _global_
        defaults:
          - /config/quick/simclr_synthetic
          - _self_
        config:
          CHECKPOINT:
            DIR: ~/runs/a
          DATA:
            TRAIN:
              DATA_LIMIT: 8
              BATCHSIZE_PER_REPLICA: 4
          OPTIMIZER:
            num_epochs: 1
        """))
    env = tool_env({"HOME": str(home)})
    run = subprocess.run([sys.executable, TOOL, f"config={cfg}"], cwd=str(cwd), env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (home / "runs" / "a" / "model_final_checkpoint_phase0.torch").is_file()
    assert list(cwd.iterdir()) == []
    assert compose([f"config={cfg}", "config.MODEL.WEIGHTS_INIT.PARAMS_FILE='~/w.torch'"],
                   warn_unused=False).MODEL.WEIGHTS_INIT.PARAMS_FILE == str(Path.home() / "w.torch")
    moved = compose([f"config={cfg}", "config.DATA.TRAIN.NEW_IMG_PATH_PREFIX='~/disk2/'"], warn_unused=False)
    assert moved.DATA.TRAIN.NEW_IMG_PATH_PREFIX == str(Path.home() / "disk2") + "/"  # the filelist's paths' new prefix
    bad = subprocess.run([sys.executable, TOOL, f"config={cfg}", "config.CHECKPOINT.DIR=~/runs/b"], cwd=str(cwd),
                         env=env, capture_output=True, text=True, timeout=300)
    err = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(err) == 1, bad.stderr[-3000:]
    assert "config.CHECKPOINT.DIR=\"~/runs/b\"" in err[0] and "$HOME" in err[0]


def test_a_yaml_file_saved_with_a_byte_order_mark(tmp_path, monkeypatch):
    """Windows editors may save UTF-8 with a BOM: the file config= names is read without it; a file
    hydra reads itself (from a config folder) is one line that says what to do, not 'lacks the header'."""
    bom = b"\xef\xbb\xbf"
    body = b"# @package _global_\nconfig:\n  OPTIMIZER:\n    num_epochs: 3\n"
    own = tmp_path / "own.yaml"
    own.write_bytes(bom + body)
    assert compose([f"config={own}"], warn_unused=False).OPTIMIZER.num_epochs == 3
    declared = tmp_path / "declared.yaml"  # its '# added keys:' line is read past the BOM too
    declared.write_bytes(bom + b"# @package _global_\n# added keys: config.MY_OWN_KEY\nconfig:\n  MY_OWN_KEY: 3\n")
    assert compose([f"config={declared}"], warn_unused=False).MY_OWN_KEY == 3
    (tmp_path / "configs" / "config").mkdir(parents=True)
    (tmp_path / "configs" / "config" / "shared.yaml").write_bytes(bom + body)
    monkeypatch.chdir(tmp_path)  # ./configs/config is on the search path
    with pytest.raises(ConfigError, match=r"shared.yaml starts with a UTF-8 byte order mark .* without BOM"):
        compose(["config=shared"], warn_unused=False)
    # named by its path (without .yaml), it is the file config= names: read without its BOM
    assert compose([f"config={tmp_path / 'configs' / 'config' / 'shared'}"], warn_unused=False).OPTIMIZER.num_epochs == 3


def test_an_override_into_a_section_a_yaml_file_set_to_a_value_names_that_value(tmp_path):
    # hydra calls it an unknown key whose closest key is itself; the cause is the file's OPTIMIZER: 5
    path = tmp_path / "scalar.yaml"
    path.write_text("# @package _global_\ndefaults:\n  - /config/quick/simclr_synthetic\n  - _self_\nconfig:\n"
                    "  OPTIMIZER: 5\n")
    with pytest.raises(ConfigError) as e:
        compose([f"config={path}", "config.OPTIMIZER.num_epochs=1"], warn_unused=False)
    assert str(e.value).startswith(f"config.OPTIMIZER=5 has the wrong type: expected mapping, got int (in {path})")
    assert "config.OPTIMIZER.num_epochs on the command line" in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown config key config.OPTIMIZER.num_epoch \(closest"):
        compose(["config=quick/simclr_synthetic", "config.OPTIMIZER.num_epoch=1"], warn_unused=False)


def test_an_override_into_a_list_entry_names_the_entry_or_the_valid_indices(tmp_path):
    # a user's yaml that lists its transforms: options of an entry are changed by index
    path = tmp_path / "mine.yaml"
    path.write_text((Path(__file__).resolve().parents[1] / "configs/config/quick/simclr_synthetic.yaml").read_text())
    cfg = compose([f"config={path}", "config.DATA.TRAIN.TRANSFORMS.1.size=40"], warn_unused=False)
    assert cfg.DATA.TRAIN.TRANSFORMS[1]["size"] == 40
    with pytest.raises(ConfigError) as e:  # was: "TRANSFORMS=[...] has the wrong type: expected mapping"
        compose([f"config={path}", "config.DATA.TRAIN.TRANSFORMS.1.ratio=[0.5,1.0]"], warn_unused=False)
    assert str(e.value) == ("config.DATA.TRAIN.TRANSFORMS.1.ratio: entry 1 of config.DATA.TRAIN.TRANSFORMS (name "
                            "RandomResizedCrop) has no option 'ratio' to change; add it with "
                            "+config.DATA.TRAIN.TRANSFORMS.1.ratio=<value>")
    with pytest.raises(ConfigError) as e:  # a misspelt option of the entry: the entry's options are the hint
        compose([f"config={path}", "config.DATA.TRAIN.TRANSFORMS.1.sise=24"], warn_unused=False)
    assert "has no option 'sise' to change (closest: size); add it with" in str(e.value)
    cfg = compose([f"config={path}", "+config.DATA.TRAIN.TRANSFORMS.1.ratio=[0.5,1.0]"], warn_unused=False)
    assert cfg.DATA.TRAIN.TRANSFORMS[1]["ratio"] == [0.5, 1.0]
    for index in ("9", "x"):  # was hydra's "Error merging override ..." / "Index 'x' (str) is not an int"
        with pytest.raises(ConfigError, match=rf"TRANSFORMS is a list of 6 entries, so '{index}' names none of them "
                                              r"\(indices: 0-5\)"):
            compose([f"config={path}", f"config.DATA.TRAIN.TRANSFORMS.{index}.size=64"], warn_unused=False)
    # a mapping given for an entry is merged into it, also with options the old entry lacks (was "unknown
    # config key"); what the old entry has and the mapping does not name stays (hydra's merge)
    before = compose([f"config={path}"], warn_unused=False).DATA.TRAIN.TRANSFORMS[2]
    cfg = compose([f"config={path}", "config.DATA.TRAIN.TRANSFORMS.2={name:RandomHorizontalFlip,p:0.3}"],
                  warn_unused=False)
    assert cfg.DATA.TRAIN.TRANSFORMS[2] == {**before, "name": "RandomHorizontalFlip", "p": 0.3}
    assert len(cfg.DATA.TRAIN.TRANSFORMS) == 6
    with pytest.raises(ConfigError, match=r"TRANSFORMS is a list of 6 entries, so '7' names none of them"):
        compose([f"config={path}", "config.DATA.TRAIN.TRANSFORMS.7={name:ToTensor}"], warn_unused=False)
    # hydra deletes keys of sections only, and its grammar has no negative index: each is one line that says so
    with pytest.raises(ConfigError) as e:  # was: "list indices must be integers or slices, not str"
        compose([f"config={path}", "~config.DATA.TRAIN.TRANSFORMS.1"], warn_unused=False)
    assert str(e.value) == ("~config.DATA.TRAIN.TRANSFORMS.1: an entry of the list config.DATA.TRAIN.TRANSFORMS cannot be "
                            "deleted on its own; give the list as you want it, config.DATA.TRAIN.TRANSFORMS=[...] "
                            "(quoted as one shell word)")
    with pytest.raises(ConfigError, match=r"TRANSFORMS.1.size: hydra deletes keys of sections, not options inside an "
                                          r"entry of the list config.DATA.TRAIN.TRANSFORMS; give the list as you want it"):
        compose([f"config={path}", "~config.DATA.TRAIN.TRANSFORMS.1.size"], warn_unused=False)
    # a number as the last part of a key that is no list entry keeps the usual unknown-key line
    with pytest.raises(ConfigError, match=r"unknown config key config.OPTIMIZER.5"):
        compose([f"config={path}", "config.OPTIMIZER.5=1"], warn_unused=False)
    with pytest.raises(ConfigError, match=r"TRANSFORMS.-1.mean: entries of config.DATA.TRAIN.TRANSFORMS are named by "
                                          r"their index counted from 0 .*a negative index is not supported"):
        compose([f"config={path}", "config.DATA.TRAIN.TRANSFORMS.-1.mean=[0.5,0.5,0.5]"], warn_unused=False)


def test_settings_that_are_not_acted_on_are_reported_also_inside_free_form_sections(caplog):
    # AMP_ARGS takes any keys (VISSL's apex options), but its [compat] opt_level set to O3 is still
    # said to be ignored; EXPERIMENT_LOG_DIR is read only under a LOG_DIR of one's own
    with caplog.at_level(logging.WARNING):
        compose(["config=quick/simclr_synthetic", "config.MODEL.AMP_PARAMS.AMP_ARGS.opt_level=O3",
                 "config.MODEL.AMP_PARAMS.USE_AMP=true",
                 "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true",
                 "config.HOOKS.TENSORBOARD_SETUP.EXPERIMENT_LOG_DIR=my_exp"])
    assert "config.MODEL.AMP_PARAMS.AMP_ARGS.opt_level is accepted for VISSL configs but not acted on" in caplog.text
    assert "EXPERIMENT_LOG_DIR=my_exp is read only with LOG_DIR set to a folder" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # apex's options of a run without AMP: nothing to say
        compose(["config=quick/simclr_synthetic", "config.MODEL.AMP_PARAMS.AMP_ARGS.opt_level=O3"])
    assert "opt_level" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        compose(["config=quick/simclr_synthetic", "config.MODEL.AMP_PARAMS.AMP_ARGS.opt_level=O1",
                 "config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true", "config.HOOKS.TENSORBOARD_SETUP.LOG_DIR=/tmp/tb",
                 "config.HOOKS.TENSORBOARD_SETUP.EXPERIMENT_LOG_DIR=my_exp"])
    assert "opt_level" not in caplog.text and "EXPERIMENT_LOG_DIR" not in caplog.text


def test_config_naming_a_folder_or_a_broken_link_with_a_yaml_name_says_what_it_is(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    with pytest.raises(ConfigError) as e:  # was: "no such file; nearest in ...: dir.yaml, dangling.yaml"
        compose([f"config={tmp_path / 'dir.yaml'}"])
    assert str(e.value) == f"config={tmp_path / 'dir.yaml'} is a folder ({tmp_path / 'dir.yaml'}), not a yaml file; " \
                           f"it holds no yaml files"
    with pytest.raises(ConfigError, match=r"dangling\.yaml is a symbolic link to .*gone\.yaml, which is no readable file"):
        compose([f"config={tmp_path / 'dangling.yaml'}"])
    with pytest.raises(ConfigError) as e:
        compose([f"config={tmp_path / 'none.yaml'}"])
    assert str(e.value) == f"config={tmp_path / 'none.yaml'}: no such file"  # neither is offered as the nearest file


def test_torchs_own_info_lines_stay_out_of_the_log(tmp_path):
    """torch logs statistics at INFO at exit (FakeTensor cache stats) once anything set its
    logger to INFO; a run's log shows its own lines, not those."""
    from ssl_engine.logger import setup_logging

    torch_log = logging.getLogger("torch")
    before = torch_log.level
    try:
        torch_log.setLevel(logging.NOTSET)  # as the root's INFO would reach it
        setup_logging(0, str(tmp_path))
        assert not logging.getLogger("torch._subclasses.fake_tensor").isEnabledFor(logging.INFO)
        assert logging.getLogger("ssl_engine.x").isEnabledFor(logging.INFO)
    finally:
        setup_logging(0, None)
        torch_log.setLevel(before)


def test_a_yaml_key_written_with_dots_is_named_as_such(tmp_path):
    """`MODEL.TRUNK.NAME: resnet` in a yaml file is one key with dots in its name, not the nested
    option: it was 'unknown config key config.MODEL.TRUNK.NAME (closest: config.SLURM.NAME)', naming
    a key that exists; under config.LOSS a dotted key holding a mapping was kept as a user loss's
    options, so `simclr_info_nce_loss.buffer_params: {...}` was dropped without a word."""
    path = write_yaml(tmp_path, "dotted.yaml", """\
        # @package _global_
        config:
          MODEL.TRUNK.NAME: mlp
        """)
    with pytest.raises(ConfigError) as e:
        compose([f"config={path}"])
    assert str(e.value) == ("config.MODEL.TRUNK.NAME: the yaml key 'MODEL.TRUNK.NAME' under config holds dots, which "
                            "yaml reads as part of one key's name, not as nested sections; nest it (MODEL: {TRUNK: "
                            "{NAME: 'mlp'}}) or give it on the command line as config.MODEL.TRUNK.NAME=...")
    path = write_yaml(tmp_path, "dotted_loss.yaml", """\
        # @package _global_
        config:
          LOSS:
            simclr_info_nce_loss.buffer_params: {embedding_dim: 32}
        """)
    with pytest.raises(ConfigError, match=r"^config\.LOSS\.simclr_info_nce_loss\.buffer_params: the yaml key "
                                          r"'simclr_info_nce_loss\.buffer_params' under config\.LOSS holds dots.*"
                                          r"nest it \(simclr_info_nce_loss: \{buffer_params: \.\.\.\}\)"):
        compose(["config=quick/simclr_synthetic", f"config={path}"])


def test_config_given_as_a_path_without_its_yaml_ending(tmp_path, monkeypatch):
    """config=/path/exp (VISSL names experiments without .yaml) where /path/exp.yaml exists reads
    that file; it was hydra's "Could not find 'config//path/exp'" listing unrelated options. A path
    that names nothing says so, instead of advising a folder holding config//path/exp.yaml."""
    write_yaml(tmp_path, "exp.yaml", """\
        # @package _global_
        config:
          LOG_FREQUENCY: 7
        """)
    assert compose([f"config={tmp_path / 'exp'}"]).LOG_FREQUENCY == 7
    monkeypatch.chdir(tmp_path)
    assert compose(["config=./exp"]).LOG_FREQUENCY == 7
    with pytest.raises(ConfigError) as e:
        compose([f"config={tmp_path / 'exq'}"])
    assert str(e.value) == f"config={tmp_path / 'exq'}: no such file (nor with .yaml added); nearest in {tmp_path}: exp.yaml"
    with pytest.raises(ConfigError, match=r"^config=exp matches no file under .*; the file exp\.yaml is named by its "
                                          r"path: config=\./exp\.yaml; the search path is"):
        compose(["config=exp"])


def test_an_overlay_given_as_a_path_says_a_group_option_is_a_name(tmp_path):
    """+config/<group>=/abs/file.yaml: the path was joined onto each group folder, which gives the
    path itself, so it passed the check and hydra failed with "Could not find 'config/models//abs/...'"."""
    tree = tmp_path / "tree" / "config"
    (tree / "models").mkdir(parents=True)
    write_yaml(tree / "models", "m.yaml", "# @package _global_\nconfig:\n  LOG_FREQUENCY: 5\n")
    experiment = write_yaml(tree, "e.yaml", "# @package _global_\nconfig:\n  LOG_FREQUENCY: 9\n")
    assert compose([f"config={experiment}", "+config/models=m"]).LOG_FREQUENCY == 5
    with pytest.raises(ConfigError) as e:
        compose([f"config={experiment}", f"+config/models={tree / 'models' / 'm.yaml'}"])
    assert str(e.value) == (f"+config/models={tree / 'models' / 'm.yaml'} is a path, but a group's option is the name "
                            f"of a yaml file in it (config/models/<name>.yaml of the config search path; options there: "
                            f"m); for a yaml file elsewhere use config=/path/to/file.yaml, or list it in a file's 'defaults:'")
    with pytest.raises(ConfigError, match=r"^\+config/models= names no file \(.*options there: m\)"):
        compose([f"config={experiment}", "+config/models="])


def test_a_vissl_key_of_a_section_not_acted_on_is_taken_from_the_command_line_as_from_a_file(caplog):
    """VISSL's `config.REPRODUCIBILITY.CUDDN_DETERMINISTIC=True` (or an option of a VISSL loss this
    engine lacks) composed from a yaml file with the not-acted-on warning, but on the command line
    it was 'unknown config key ... to add a key of your own use +...': hydra knew only the {} of
    defaults.yaml. It is taken the same way from both now."""
    with caplog.at_level(logging.WARNING, logger="ssl_engine"):
        cfg = compose([QUICK, "config.REPRODUCIBILITY.CUDDN_DETERMINISTIC=true", "config.SVM.cross_val_folds=3",
                       "config.LOSS.dino_loss.some_option=1", "config.LOSS.nce_loss_with_memory.ignore_index=-1"])
    assert cfg.REPRODUCIBILITY.CUDDN_DETERMINISTIC is True and cfg.SVM.cross_val_folds == 3
    assert cfg.LOSS.dino_loss.some_option == 1 and cfg.LOSS.nce_loss_with_memory.ignore_index == -1
    warned = [r.getMessage() for r in caplog.records]
    assert ("config key config.LOSS.nce_loss_with_memory.ignore_index is accepted for VISSL configs but not acted on "
            "by ssl_engine") in warned
    assert any(w.startswith("config key config.REPRODUCIBILITY configures") for w in warned), warned
    assert "config key config.LOSS.dino_loss.some_option is accepted for VISSL configs but not acted on by ssl_engine" \
        in warned
    # a key beside the sections the engine acts on is still unknown
    with pytest.raises(ConfigError, match=r"^unknown config key config\.LOSS\.simclr_info_nce_loss\.some_option "):
        compose([QUICK, "config.LOSS.simclr_info_nce_loss.some_option=1"])


def test_a_key_deleted_then_set_again_on_the_command_line_takes_the_new_value():
    """`~config.OPTIMIZER.num_epochs config.OPTIMIZER.num_epochs=5` (a script's deletion, then the
    user's value) was 'unknown config key config.OPTIMIZER.num_epochs (closest: config.OPTIMIZER.num_epochs)'."""
    assert compose([QUICK, "~config.OPTIMIZER.num_epochs", "config.OPTIMIZER.num_epochs=5"]).OPTIMIZER.num_epochs == 5
    cfg = compose([QUICK, "~config.OPTIMIZER", "config.OPTIMIZER.num_epochs=5"])
    assert cfg.OPTIMIZER.num_epochs == 5 and cfg.OPTIMIZER.name == "sgd"  # the rest of the section: its defaults
    with pytest.raises(ConfigError, match=r"^unknown config key config\.OPTIMIZER\.num_epoch \(closest: config\.OPTIMIZER\.num_epochs\)"):
        compose([QUICK, "~config.OPTIMIZER", "config.OPTIMIZER.num_epoch=5"])


@pytest.mark.parametrize("override, instead", [
    ("hydra.verbose=true", "config.VERBOSE=true"),
    ("hydra.run.dir=/tmp/elsewhere", "config.CHECKPOINT.DIR"),
    ("+hydra.job.chdir=true", "under config."),
    ("hydra.searchpath=[file:///tmp/x]", "SSL_ENGINE_CONFIG_DIR"),
])
def test_hydra_settings_on_the_command_line_are_refused_not_ignored(override, instead):
    # the tool composes with hydra's compose API: hydra's run dir, logging and sweeps never act
    with pytest.raises(ConfigError, match=re.escape(f"override {override!r} is not acted on")) as e:
        compose([QUICK, override])
    assert instead in str(e.value)


def test_the_tool_refuses_a_hydra_setting_in_one_line(tmp_path):
    from conftest import run_tool

    proc = run_tool([QUICK, "hydra.run.dir=/tmp/elsewhere", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: override 'hydra.run.dir=/tmp/elsewhere' is not acted on")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("section", ["config.OPTIMIZER", "config.HOOKS.PERF_STATS"])
def test_a_whole_section_set_to_null_on_the_command_line_is_refused(section):
    # it used to take the section's defaults silently: the file's settings and num_epochs=1 were lost
    with pytest.raises(ConfigError) as e:
        compose([QUICK, "config.OPTIMIZER.num_epochs=1", f"{section}=null"])
    assert str(e.value).startswith(f"{section}=null: a config section cannot be null")
    assert f"~{section}" in str(e.value)


def test_a_section_header_with_nothing_under_it_in_a_yaml_file_still_takes_its_defaults(tmp_path):
    path = write_yaml(tmp_path, "x.yaml", """\
        # @package _global_
        defaults:
          - /config/quick/supervised_digits@_here_
        config:
          HOOKS:
            PERF_STATS:
        """)
    cfg = compose([f"config={path}"])
    assert cfg.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY == -1


@pytest.mark.parametrize("override, expected", [
    ("config.HOOKS.ITERATION_TIMER.WARMUP_ITERATIONS=-5", "expected an integer >= 0"),
    ("config.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY=-7", "expected -1 or 0 (the breakdown at phase ends only"),
    ("config.HOOKS.MEMORY_SUMMARY.LOG_EVERY_N_ITERS=-7", "expected -1 or 0 (no memory line) or N >= 1"),
    ("config.HOOKS.MEMORY_SUMMARY.LOG_ITERATION_NUM=-3", "expected an integer >= 0 (the train iteration after which"),
])
def test_hook_warmups_and_periods_out_of_range(override, expected):
    # a negative warm-up was read as 0, a frequency below -1 as -1, a memory period below -1 as never, without a word
    with pytest.raises(ConfigError, match=re.escape(f"{override} is out of range: {expected}")):
        compose([QUICK, override])


def test_perf_stat_frequency_0_is_phase_ends_only_and_unread_without_monitoring(caplog):
    cfg = compose([QUICK, "config.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY=0"])  # VISSL reads <= 0 as -1
    assert cfg.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY == 0
    with caplog.at_level(logging.WARNING):
        compose([QUICK, "config.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY=5"])
    assert any("PERF_STAT_FREQUENCY=5 is not acted on" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        compose([QUICK, "config.HOOKS.PERF_STATS.PERF_STAT_FREQUENCY=5", "config.HOOKS.PERF_STATS.MONITOR_PERF_STATS=true"])
    assert not any("PERF_STAT_FREQUENCY" in r.getMessage() for r in caplog.records)


def test_a_hydra_section_in_a_yaml_file_is_named_in_a_warning(tmp_path, caplog):
    """VISSL composes a yaml file with a 'hydra:' section and ignores it: so does ssl_engine, with
    a warning naming the file and the engine's key instead (it was ignored without a word)."""
    path = write_yaml(tmp_path, "x.yaml", """\
        # @package _global_
        hydra:
          run:
            dir: /tmp/elsewhere
        config:
          LOG_FREQUENCY: 3
        """)
    with caplog.at_level(logging.WARNING):
        cfg = compose([f"config={path}"])
    assert cfg.LOG_FREQUENCY == 3
    warned = [r.getMessage() for r in caplog.records if "'hydra:' section is not acted on" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0] and "config.CHECKPOINT.DIR" in warned[0]


def test_options_of_a_meter_no_key_names_are_reported(tmp_path, caplog):
    """VISSL's MoCo linear-evaluation config sets METERS.accuracy_list_meter without METERS.name:
    as in VISSL no meter runs, so the run reports no accuracy; that is said once, with the key
    that turns the meter on (was: silent, a linear evaluation without any accuracy)."""
    path = write_yaml(tmp_path, "moco_linear.yaml", textwrap.dedent("""\
        # @package _global_
        config:
          METERS:
            accuracy_list_meter:
              num_meters: 1
              topk_values: [1, 5]
        """))
    with caplog.at_level(logging.WARNING):
        cfg = compose([f"config={path}"])
    assert cfg.METERS.name == "" and not cfg.METERS.names
    assert ("config.METERS.accuracy_list_meter is set (topk_values=[1, 5]) but no meter is named (config.METERS.name "
            "is '' and names is []): it does not run and its values are not reported (as in VISSL, only a named meter "
            "runs); set config.METERS.name=accuracy_list_meter to run it") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # another meter named: the line names the list to give
        compose([f"config={path}", "config.METERS.names=[precision_at_k_list_meter]"])
    assert "set config.METERS.names=[accuracy_list_meter,precision_at_k_list_meter] to run it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # named, or set as the defaults are: nothing to say
        compose([f"config={path}", "config.METERS.name=accuracy_list_meter"])
        compose(["config=quick/linear_eval_digits"])
        compose(["config=quick/simclr_synthetic", "config.METERS.accuracy_list_meter.topk_values=[1]"])
    assert "METERS" not in caplog.text, caplog.text


def test_an_environment_variable_given_to_an_int_key_names_how_to_read_it_as_a_number(tmp_path, monkeypatch):
    """${oc.env:NAME} always gives text, so num_epochs=${oc.env:EPOCHS} with EPOCHS=2 was "'2' has the
    wrong type: expected int, got string", and the nested ${oc.decode:...} that reads it as a number is
    taken by hydra only quoted. The line says so, and the override it shows composes to the int."""
    import shlex

    from conftest import run_tool

    monkeypatch.setenv("SSL_TEST_EPOCHS", "2")
    done = run_tool([QUICK, f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
                     "config.OPTIMIZER.num_epochs=${oc.env:SSL_TEST_EPOCHS}"], env={"SSL_TEST_EPOCHS": "2"})
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "config.OPTIMIZER.num_epochs='2' has the wrong type: expected int, got string (text that reads as int" in line
    assert not (tmp_path / "run").exists()
    advised = shlex.split(line.split("on the command line quoted for hydra: ", 1)[1].rstrip(")"))
    assert len(advised) == 1, line
    cfg = compose([QUICK, advised[0].replace("NAME", "SSL_TEST_EPOCHS")])
    assert cfg.OPTIMIZER.num_epochs == 2 and type(cfg.OPTIMIZER.num_epochs) is int
    with pytest.raises(ConfigError) as e:  # text that does not read as the type gets no note
        compose([QUICK, "config.OPTIMIZER.num_epochs=two"])
    assert "reads as" not in str(e.value)


def test_a_nested_interpolation_unquoted_names_the_quoting_that_composes(monkeypatch):
    """hydra reads an unquoted ${oc.decode:${oc.env:NAME}} up to its first '}'; the line was "cannot be
    parsed (extraneous input '}' expecting <EOF>); quote lists and mappings ...". It now shows the one
    shell word that hydra reads, which composes to the variable's value."""
    import shlex

    monkeypatch.setenv("SSL_TEST_EPOCHS", "3")
    with pytest.raises(ConfigError, match="hydra takes an interpolation nested in another only quoted") as e:
        compose([QUICK, "config.OPTIMIZER.num_epochs=${oc.decode:${oc.env:SSL_TEST_EPOCHS}}"])
    advised = shlex.split(str(e.value).split("inside the shell word: ", 1)[1])
    assert len(advised) == 1, str(e.value)
    assert compose([QUICK, advised[0]]).OPTIMIZER.num_epochs == 3


def test_an_interpolation_naming_no_key_names_the_closest_keys_and_where_it_was_written(tmp_path):
    """${config.OPTIMIZER.num_epoch} was "cannot compose the config: Interpolation key ... not found
    full_key: ... object_type=dict": no closest key, and not the file that wrote it. Through the tool."""
    from conftest import run_tool

    exp = write_yaml(tmp_path, "exp.yaml", """\
        # @package _global_
        defaults:
          - /config/quick/supervised_digits
          - _self_
        config:
          LOG_FREQUENCY: ${config.LOG_FREQ}
        """)
    done = run_tool([f"config={exp}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        f"error: config.LOG_FREQUENCY=${{config.LOG_FREQ}}, set in {exp}: its interpolation names no key config.LOG_FREQ "
        "(closest: ${config.LOG_FREQUENCY}); an interpolation names a key by its full path, e.g. ${config.SEED_VALUE}")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=re.escape(
            "config.OPTIMIZER.num_epochs=${config.OPTIMIZER.num_epoch}, set on the command line: its interpolation "
            "names no key config.OPTIMIZER.num_epoch (closest: ${config.OPTIMIZER.num_epochs})")):
        compose([QUICK, "config.OPTIMIZER.num_epochs=${config.OPTIMIZER.num_epoch}"])


def test_a_list_entry_override_is_explained_against_the_list_an_earlier_override_gave():
    """TRANSFORMS=[two entries] then TRANSFORMS.5.size=8: the line named entry 5 of the file's list
    ("(name Normalize) has no option 'size'"), a list the run would not have; and entry 1 by the
    file's transform, not the one the earlier override put there."""
    whole = "config.DATA.TRAIN.TRANSFORMS=[{name:RandomResizedCrop,size:16},{name:ToTensor}]"
    with pytest.raises(ConfigError, match=re.escape(
            "config.DATA.TRAIN.TRANSFORMS.5.size: config.DATA.TRAIN.TRANSFORMS is a list of 2 entries, so '5' "
            "names none of them (indices: 0-1)")):
        compose([QUICK, whole, "config.DATA.TRAIN.TRANSFORMS.5.size=8"])
    with pytest.raises(ConfigError, match=re.escape("entry 1 of config.DATA.TRAIN.TRANSFORMS (name ToTensor) has no "
                                                    "option 'size' to change")):
        compose([QUICK, whole, "config.DATA.TRAIN.TRANSFORMS.1.size=8"])
    assert compose([QUICK, whole, "config.DATA.TRAIN.TRANSFORMS.0.size=8"]).DATA.TRAIN.TRANSFORMS[0].size == 8


def test_an_unset_environment_variable_names_the_key_the_variable_and_the_default_syntax(monkeypatch):
    """${oc.env:NAME} of an unset variable was "cannot compose the config: KeyError raised while resolving
    interpolation: ... object_type=dict", without the way to give a default."""
    monkeypatch.delenv("SSL_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as e:
        compose([QUICK, "config.CHECKPOINT.DIR=${oc.env:SSL_TEST_UNSET}/run"])
    assert str(e.value) == ("config.CHECKPOINT.DIR: its interpolation ${oc.env:SSL_TEST_UNSET} names the environment "
                            "variable SSL_TEST_UNSET, which is not set; set it, or give a default after a comma: "
                            "${oc.env:SSL_TEST_UNSET,<default>}")


def test_a_config_file_path_with_a_slash_after_it_says_so(tmp_path):
    """config=/path/exp.yaml/ was "a file without a .yaml ending ... rename it to exp.yaml.yaml"."""
    exp = write_yaml(tmp_path, "exp.yaml", "# @package _global_\nconfig:\n  LOG_FREQUENCY: 3\n")
    with pytest.raises(ConfigError) as e:
        compose([f"config={exp}/"])
    assert str(e.value) == f"config={exp}/ names the file {exp} as a folder ('/' after its name); write config={exp}"


@pytest.mark.parametrize("value", ["/data/a=b", "/data/run(1)", "/data/run[1]", "/data/it's", "/data/x)"])
def test_the_quoting_advice_for_a_path_holding_a_grammar_character_composes_to_the_path(value):
    """A path holding = ( ) [ ] or ' was "cannot be parsed (...); quote lists and mappings as one shell
    word", advice for another mistake. The advice is now the one shell word that gives the path."""
    import shlex

    with pytest.raises(ConfigError, match="only quoted; quote it for hydra inside the shell word") as e:
        compose([QUICK, f"config.CHECKPOINT.DIR={value}"])
    words = shlex.split(str(e.value).split("inside the shell word: ", 1)[1])
    assert len(words) == 1, str(e.value)
    assert compose([QUICK, words[0]]).CHECKPOINT.DIR == value


@pytest.mark.parametrize("override, expected", [
    # omegaconf's select writes an index in brackets; hydra's grammar takes it as a key part
    ("config.DATA.TRAIN.TRANSFORMS[1].size=3", "override 'config.DATA.TRAIN.TRANSFORMS[1].size=3': hydra names an entry "
     "of a list by its index as a part of the key, without brackets: config.DATA.TRAIN.TRANSFORMS.1.size=3"),
    ("config.OPTIMIZER..num_epochs=1", "override 'config.OPTIMIZER..num_epochs=1' has an invalid key "
     "'config.OPTIMIZER..num_epochs'"),
    ("+~config.LOG_FREQUENCY=1", "has an invalid key '+~config.LOG_FREQUENCY'"),
])
def test_an_override_whose_key_hydra_cannot_read_is_blamed_on_the_key(override, expected):
    """Was "cannot be parsed (token recognition error at: '['); quote lists and mappings as one shell
    word", advice about the value for a fault of the key."""
    with pytest.raises(ConfigError) as e:
        compose([QUICK, override])
    assert expected in str(e.value) and "quote lists" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override, where", [("config.DATA.TRAIN.TRANSFORMS=[ToTensor]", "config.DATA.TRAIN.TRANSFORMS[0]"),
                                             ("config.HOOKS.CUSTOM=[PreciseBNHook]", "config.HOOKS.CUSTOM[0]")])
def test_a_part_named_alone_in_a_list_of_named_parts_is_shown_as_its_mapping(override, where):
    """TRANSFORMS=[ToTensor] was "needs a 'name' key", though it was a name."""
    from ssl_engine.config.validate import check_registered_names

    name = override.split("[")[1].rstrip("]")
    with pytest.raises(ConfigError) as e:
        check_registered_names(compose([QUICK, override]))
    assert str(e.value) == f"{where}='{name}' is a name alone; an entry is a mapping with a 'name' key: {{name: {name}}}"


def test_a_relative_output_folder_under_an_unwritable_working_folder_names_that_folder(tmp_path, monkeypatch):
    """CHECKPOINT.DIR=rel_run in a folder this user cannot write was "cannot be created: . is not
    writable": the folder is now named by its path."""
    import os

    from ssl_engine.config.validate import check_output_folder

    monkeypatch.chdir(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p).resolve() == tmp_path.resolve() else real_access(p, mode))
    with pytest.raises(ConfigError) as e:
        check_output_folder("rel_run", "config.CHECKPOINT.DIR")
    assert str(e.value) == f"config.CHECKPOINT.DIR=rel_run cannot be created: {tmp_path} is not writable by this user"


def test_a_mapping_that_is_empty_in_the_defaults_is_set_from_the_command_line_as_from_a_yaml_file(tmp_path):
    """SLURM.ADDITIONAL_PARAMETERS, COLLATE_FUNCTION_PARAMS (``{}`` in defaults.yaml: the options of
    sbatch or of a part): a yaml file gave them, but the command line's {exclusive: true, qos: high}, the
    README's example, was "holds keys config.SLURM.ADDITIONAL_PARAMETERS does not have"."""
    cfg = compose([QUICK, "config.SLURM.ADDITIONAL_PARAMETERS={exclusive: true, qos: high}",
                   "config.DATA.TRAIN.COLLATE_FUNCTION_PARAMS.foo=1"])
    assert cfg.SLURM.ADDITIONAL_PARAMETERS == {"exclusive": True, "qos": "high"}
    assert cfg.DATA.TRAIN.COLLATE_FUNCTION_PARAMS == {"foo": 1}
    exp = write_yaml(tmp_path, "exp.yaml", """\
        # @package _global_
        defaults:
          - /config/quick/supervised_digits
          - _self_
        config:
          SLURM:
            ADDITIONAL_PARAMETERS: {exclusive: true}
        """)
    assert compose([f"config={exp}"]).SLURM.ADDITIONAL_PARAMETERS == {"exclusive": True}
    assert compose([f"config={exp}", "config.SLURM.ADDITIONAL_PARAMETERS.qos=high"]).SLURM.ADDITIONAL_PARAMETERS == {
        "exclusive": True, "qos": "high"}


def test_a_defaults_entry_naming_a_file_beside_the_experiment_says_how_it_is_found(tmp_path):
    """config=/path/exp.yaml whose defaults: lists '- base' for /path/base.yaml beside it: the line named
    only config/base and the package's folder. It now names the file beside it, and the way that works
    (both files in a folder named config/) composes."""
    base = "# @package _global_\ndefaults:\n  - /config/quick/supervised_digits\n  - _self_\nconfig:\n  LOG_FREQUENCY: 7\n"
    exp = "# @package _global_\ndefaults:\n  - base\n  - _self_\nconfig:\n  SEED_VALUE: 3\n"
    write_yaml(tmp_path, "base.yaml", base)
    with pytest.raises(ConfigError, match=re.escape(
            f"the file {tmp_path / 'base.yaml'} beside it is not read: entries name files of the config folders, "
            "not of the file's own folder; put both files in a folder named config/")):
        compose([f"config={write_yaml(tmp_path, 'exp.yaml', exp)}"])
    (tmp_path / "config").mkdir()
    write_yaml(tmp_path / "config", "base.yaml", base)
    cfg = compose([f"config={write_yaml(tmp_path / 'config', 'exp.yaml', exp)}"])
    assert (cfg.LOG_FREQUENCY, cfg.SEED_VALUE) == (7, 3)


def test_a_list_given_to_a_free_form_section_names_the_override_as_given():
    """MODEL.TRUNK.REGNET=[1]: the line showed '++config.MODEL.TRUNK.REGNET=[1]', the form the tool
    hands hydra for a free-form section, not what the user wrote."""
    with pytest.raises(ConfigError) as e:
        compose([QUICK, "config.MODEL.TRUNK.REGNET=[1]"])
    assert str(e.value).startswith("config.MODEL.TRUNK.REGNET=[1] gives a list, but config.MODEL.TRUNK.REGNET is a "
                                   "section of options"), str(e.value)
