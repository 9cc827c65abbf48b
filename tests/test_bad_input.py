"""Bad input through the real tool: each row of the table runs tools/run_distributed_engines.py
with one mistake and expects exit code 2, a single line on stderr naming the key, file or value
(and what would be valid), and the pre-existing checkpoint folder it points at unchanged.

The rows run two at a time in subprocesses, once per session (a module fixture); each row is
then its own test. The property tests at the end feed random override strings and random
yaml documents to ssl_engine.config.compose: it composes or raises ConfigError, nothing else.
"""

import hashlib
import logging
import os
import shutil
import string
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TOOL, run_tool, tool_env
from tv_formats import write_dataset
from ssl_engine import checkpoint as ck
from ssl_engine.errors import ConfigError, UserError

BASE = [
    "config=quick/supervised_digits",
    "config.OPTIMIZER.num_epochs=2",
    "config.TEST_MODEL=false",
    "config.DATA.TRAIN.DATA_LIMIT=32",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16",
    "config.MODEL.TRUNK.NAME=mlp",
    "config.MODEL.TRUNK.MLP.DIMS=[3072,16]",
    "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}]]",
]


# a VISSL model-zoo file, as users paste it into PARAMS_FILE
ZOO_URL = ("https://dl.fbaipublicfiles.com/vissl/model_zoo/simclr_rn50_800ep_simclr_8node_resnet_16_07_20.7e8feed1/"
           "model_final_checkpoint_phase799.torch")

# the TRAIN split read from a CIFAR-10 folder by the torchvision_dataset source
TV_CIFAR = ("config.DATA.TRAIN.DATA_SOURCES=[torchvision_dataset]", "config.DATA.TRAIN.LABEL_SOURCES=[torchvision_dataset]",
            "config.DATA.TRAIN.DATASET_NAMES=[CIFAR10]")


class Row(NamedTuple):
    """One bad input: the arguments after BASE, the strings its error line must hold, the
    folder it points CHECKPOINT.DIR at ('run': a resumable run; 'fresh': no checkpoint yet), and
    whether it runs through the real tool in a subprocess or through the tool's main() in this
    process (rows that need torch cost seconds of import each as subprocesses)."""

    id: str
    args: Tuple[str, ...]
    must: Tuple[str, ...]
    folder: str = "run"
    tool: bool = True


R = Row
WORKERS_BEYOND = max(64, 8 * (os.cpu_count() or 1)) + 1
ROWS: List[Row] = [
    # -- keys, types, ranges (the config alone) ---------------------------------------------------
    R("unknown-key", ("config.OPTIMIZER.num_epoch=3",),
      ("unknown config key config.OPTIMIZER.num_epoch", "closest: config.OPTIMIZER.num_epochs")),
    R("unknown-key-nested", ("config.DATA.TRAIN.BATCHSIZE=8",),
      ("config.DATA.TRAIN.BATCHSIZE", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA")),
    R("section-given-whole-with-a-misspelt-key", ("config.OPTIMIZER={name: sgd, momentm: 0.9}",),
      ("config.OPTIMIZER={name: sgd, momentm: 0.9} holds a key config.OPTIMIZER does not have: momentm",
       "closest: momentum", "+config.OPTIMIZER.momentm=0.9"), tool=False),
    # hydra reads {name:sgd,momentm:[1,2]} as two keys; read back as yaml it was the keys 'name:sgd' and
    # 'momentm:[1,2]': the known key name was named as unknown, and the advice was +config.OPTIMIZER.name:sgd=null
    R("section-given-whole-unspaced", ("config.OPTIMIZER={name:sgd,momentm:[1,2]}",),
      ("holds a key config.OPTIMIZER does not have: momentm (closest: momentum)",
       "add it as your own with '+config.OPTIMIZER.momentm=[1,2]'"), tool=False),
    # sweeps and hydra's own flags: hydra's line advised --multirun, which the tool then called an unknown option
    R("sweep-simple-form", ("config.OPTIMIZER.num_epochs=1,2",),
      ("override 'config.OPTIMIZER.num_epochs=1,2' is a sweep over 2 values", "'config.OPTIMIZER.num_epochs=[1,2]'",
       "'config.OPTIMIZER.num_epochs=\"1,2\"'", "run it once per value")),
    R("sweep-function", ("config.OPTIMIZER.weight_decay=choice(0.1,0.2)",),
      ("override 'config.OPTIMIZER.weight_decay=choice(0.1,0.2)' is a sweep (choice)", "run it once per value"),
      tool=False),
    R("hydra-multirun-flag", ("-m", "config.OPTIMIZER.num_epochs=1,2"),
      ("-m is a flag of hydra's own command line, which the tool does not have", "run it once per value")),
    R("hydra-cfg-flag", ("--cfg", "job"),
      ("--cfg is a flag of hydra's own command line", "config.VERBOSE=true logs the composed config"), tool=False),
    R("unknown-key-in-yaml", ("config={fx}/unknown_key.yaml",),
      ("config.OPTIMIZER.num_epoch", "closest: config.OPTIMIZER.num_epochs")),
    R("wrong-type-int", ("config.OPTIMIZER.num_epochs=two",),
      ("config.OPTIMIZER.num_epochs='two'", "expected int, got string")),
    R("wrong-type-bool", ("config.TEST_MODEL=maybe",), ("config.TEST_MODEL='maybe'", "expected bool")),
    R("wrong-type-list", ("config.DATA.TRAIN.DATA_SOURCES=digits",),
      ("config.DATA.TRAIN.DATA_SOURCES='digits'", "expected list")),
    R("wrong-type-null", ("config.LOG_FREQUENCY=null",), ("config.LOG_FREQUENCY=null", "expected int")),
    R("negative-batch-size", ("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=-4",),
      ("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=-4", "expected an integer > 0")),
    R("zero-epochs", ("config.OPTIMIZER.num_epochs=0",), ("config.OPTIMIZER.num_epochs=0", "expected an integer in 1..1000000")),
    R("loader-workers-absurd", ("config.DATA.NUM_DATALOADER_WORKERS=100000",),
      ("config.DATA.NUM_DATALOADER_WORKERS=100000 is out of range", "an integer in 0..1024")),
    R("unknown-device", ("config.MACHINE.DEVICE=tpu",), ("config.MACHINE.DEVICE='tpu'", "one of cpu, gpu")),
    R("log-frequency-zero", ("config.LOG_FREQUENCY=0",), ("config.LOG_FREQUENCY=0", "expected an integer > 0")),
    # SummaryWriter(flush_secs=0) spins its writer thread through the whole run (4-6x slower training)
    R("tensorboard-flush-zero", ("config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true",
                                 "config.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=0"),
      ("config.HOOKS.TENSORBOARD_SETUP.FLUSH_EVERY_N_MIN=0 is out of range", "an integer > 0 (minutes)")),
    # torch's ValueError in every rank after launch (a traceback, exit 1); rmsprop took momentum 1.5 and diverged
    R("adam-beta-not-below-one", ("config.OPTIMIZER.name=adam", "config.OPTIMIZER.betas=[0.9,1.5]"),
      ("config.OPTIMIZER.betas=[0.9, 1.5]", "each beta must be in [0, 1)")),
    R("rmsprop-momentum-above-one", ("config.OPTIMIZER.name=rmsprop", "config.OPTIMIZER.momentum=1.5"),
      ("config.OPTIMIZER.momentum=1.5 must be in [0, 1)",)),
    # [1.5, -0.5] sums to 1: it trained the warm-up over the whole run and never reached the cosine
    R("composite-negative-length",
      ("config.OPTIMIZER.param_schedulers.lr.name=composite",
       "config.OPTIMIZER.param_schedulers.lr.schedulers=[{name:linear,start_value:0.01,end_value:0.1},"
       "{name:cosine,start_value:0.1,end_value:0.0}]",
       "config.OPTIMIZER.param_schedulers.lr.lengths=[1.5,-0.5]"),
      ("config.OPTIMIZER.param_schedulers.lr.lengths=[1.5, -0.5] must be fractions of training >= 0",)),
    # was "...param_schedulers.lr gives the learning rate -0.00375 at 0% of training", naming neither key nor value
    R("auto-lr-scaling-negative-base-value",
      ("config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=true",
       "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_value=-0.06"),
      ("config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_value=-0.06 must be a learning rate >= 0",)),
    R("nan-number", ("config.OPTIMIZER.weight_decay=nan",), ("config.OPTIMIZER.weight_decay=nan", "finite")),
    R("empty-checkpoint-dir", ("config.CHECKPOINT.DIR=",), ("config.CHECKPOINT.DIR=''", "folder path")),
    # writable by its access bits, yet no folder can be made there (as an automount that does not mount)
    R("checkpoint-dir-cannot-be-made", ("config.CHECKPOINT.DIR=/proc/ssl_engine_nope/run",),
      ("config.CHECKPOINT.DIR=/proc/ssl_engine_nope/run cannot be created: No such file or directory (in /proc)",)),
    # an entry of a list of names that is a list, mapping, bool or null: a TypeError traceback while
    # composing (METERS.names) or when the weights load (SKIP_LAYERS), exit 1
    R("meter-names-entry-not-a-name", ("config.METERS.names=[[accuracy_list_meter]]",),
      ("config.METERS.names[0]=['accuracy_list_meter'] has the wrong type: expected string, got list",)),
    R("skip-layers-entry-not-a-name", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/whole.torch",
                                       "config.MODEL.WEIGHTS_INIT.SKIP_LAYERS=[num_batches_tracked,[fc1]]"),
      ("config.MODEL.WEIGHTS_INIT.SKIP_LAYERS[1]=['fc1'] has the wrong type: expected string, got list",),
      folder="fresh", tool=False),
    R("yaml-name-list-entry-not-a-name", ("config={fx}/skip_layers_null.yaml",),
      ("config.MODEL.WEIGHTS_INIT.SKIP_LAYERS[0]=true has the wrong type: expected string, got bool",
       "set in {fx}/skip_layers_null.yaml"), folder="fresh", tool=False),
    # -- yaml files and config= --------------------------------------------------------------------
    R("malformed-yaml", ("config={fx}/malformed.yaml",), ("malformed yaml in {fx}/malformed.yaml:5",)),
    R("yaml-python-tag", ("config={fx}/python_tag.yaml",),
      ("{fx}/python_tag.yaml:3", "refused the tag !!python/object/apply:os.system")),
    R("yaml-not-a-mapping", ("config={fx}/a_list.yaml",), ("{fx}/a_list.yaml holds a list, not a mapping",)),
    R("yaml-duplicate-key", ("config={fx}/duplicate.yaml",),
      ("{fx}/duplicate.yaml:4", "duplicate key 'LOG_FREQUENCY'")),
    # a section whose defaults hold no option: hydra's "Cannot merge DictConfig with ListConfig", naming no key
    R("yaml-list-for-an-empty-section", ("config={fx}/collate_params_list.yaml",),
      ("config file {fx}/collate_params_list.yaml: config.DATA.TRAIN.COLLATE_FUNCTION_PARAMS holds a list, but it is "
       "a section: expected a mapping of its options (e.g. COLLATE_FUNCTION_PARAMS: {option: value})",)),
    # was "cannot compose the config: ConfigCompositionException" (omegaconf refused the key, naming nothing)
    R("yaml-null-key", ("config={fx}/null_key.yaml",),
      ("malformed yaml in {fx}/null_key.yaml:5: a mapping key is null", "name the option")),
    # a file the experiment's defaults: list merges is checked as the experiment is: hydra's own errors
    # named no key ("Cannot merge DictConfig with ListConfig") or nothing ("ConfigCompositionException")
    R("yaml-included-by-defaults-has-a-list-for-a-section", ("config={fx}/tree/config/exp/uses_parts.yaml",),
      ("config file {fx}/tree/config/parts/data_list.yaml: config.DATA holds a list, but it is a section",)),
    R("yaml-included-by-defaults-has-a-null-key", ("config={fx}/tree/config/exp/uses_null_key.yaml",),
      ("malformed yaml in {fx}/tree/config/parts/null_key.yaml:3: a mapping key is null",), tool=False),
    # hydra merges ??? as "no value here": the run trained from a random init (PARAMS_FILE kept its
    # earlier value, ''), exit 0, with nothing said
    R("yaml-placeholder-left-unset", ("config={fx}/placeholder.yaml",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE is ??? in {fx}/placeholder.yaml (a value left to be given)",
       "config.MODEL.WEIGHTS_INIT.PARAMS_FILE=..."), folder="fresh"),
    R("config-no-such-name", ("config=quick/supervised_digit",),
      ("config=quick/supervised_digit matches no file", "nearest: quick/supervised_digits",
       "SSL_ENGINE_CONFIG_DIR is not set (set it to a folder holding config/quick/supervised_digit.yaml)")),
    R("config-file-without-yaml-ending", ("config={fx}/experiment",),
      ("config={fx}/experiment is a file without a .yaml ending", "rename it to experiment.yaml"), tool=False),
    R("config-no-such-file", ("config={fx}/nothere.yaml",), ("config={fx}/nothere.yaml: no such file",)),
    # -- the command line ---------------------------------------------------------------------------
    R("override-not-key-value", ("config.OPTIMIZER.num_epochs",),
      ("override 'config.OPTIMIZER.num_epochs' is not of the form key=value",)),
    R("override-bad-grammar", ("config.MODEL.HEAD.PARAMS=[[mlp,",),
      ("override 'config.MODEL.HEAD.PARAMS=[[mlp,' cannot be parsed",)),
    R("override-non-ascii-value", ("config.CHECKPOINT.DIR=/tmp/ünï",),
      ("override 'config.CHECKPOINT.DIR=/tmp/ünï' cannot be parsed: hydra takes a value holding 'ü' only quoted",
       """'config.CHECKPOINT.DIR="/tmp/ünï"'""")),
    R("override-non-ascii-list-element", ("config.DATA.TRAIN.DATA_PATHS=[/tmp/ünï]",),
      ("hydra takes a value holding 'ü' only quoted; quote each element",
       """'config.DATA.TRAIN.DATA_PATHS=["/tmp/ünï"]'"""), tool=False),
    R("add-existing-key", ("+config.LOG_FREQUENCY=3",), ("+config.LOG_FREQUENCY", "already exists")),
    R("unknown-option", ("--epochs=3",), ("unknown option '--epochs=3'",)),
    # --engine= was dropped: the run trained, whatever engine the user had meant to name
    R("engine-option-empty", ("--engine=",), ("unknown engine '' (config key engine_name); known: extract_features, train",),
      tool=False),
    # argparse's spelling (--engine extract_features) was "unknown option '--engine'"
    R("engine-option-as-two-words", ("--engine", "extract_features"),
      ("write the engine as one word, --engine=extract_features",)),
    R("node-id-not-int", ("node_id=first",), ("node_id='first' is not an integer",)),
    # -- registry names -----------------------------------------------------------------------------
    R("unknown-trunk", ("config.MODEL.TRUNK.NAME=resnt",),
      ("unknown trunk 'resnt'", "config.MODEL.TRUNK.NAME", "known: mlp, regnet, resnet")),
    R("unknown-loss", ("config.LOSS.name=cross_entropy",), ("unknown loss 'cross_entropy'", "config.LOSS.name", "known:"),
    tool=False),
    # a part of a VISSL method this engine lacks is named as such, with no "did you mean" another
    # implemented part (deepclusterv2_loss is not swav_loss) and how to register one's own
    R("vissl-loss-not-implemented", ("config.LOSS.name=deepclusterv2_loss",),
      ("loss 'deepclusterv2_loss' (config key config.LOSS.name) is one of VISSL's that ssl_engine does not implement",
       "implemented: CrossEntropyLoss,", "@LOSSES.register('deepclusterv2_loss') in a file listed in config.USER_MODULES"), tool=False),
    # parts of VISSL's main branch after 0.1.6, named by its later configs: no "did you mean" the
    # hard-label loss for the soft-target one, or the collator without mixup for the one with it
    R("vissl-later-loss-not-implemented", ("config.LOSS.name=soft_target_cross_entropy_multiple_output_single_target",),
      ("loss 'soft_target_cross_entropy_multiple_output_single_target' (config key config.LOSS.name) is one of "
       "VISSL's that ssl_engine does not implement",), tool=False),
    R("vissl-later-collator-not-implemented", ("config.DATA.TRAIN.COLLATE_FUNCTION=multicrop_mixup_collator",),
      ("collator 'multicrop_mixup_collator' (config key config.DATA.TRAIN.COLLATE_FUNCTION) is one of VISSL's that "
       "ssl_engine does not implement", "@COLLATORS.register('multicrop_mixup_collator')"), tool=False),
    R("vissl-trunk-not-implemented", ("config.MODEL.TRUNK.NAME=vision_transformer",),
      ("trunk 'vision_transformer' (config key config.MODEL.TRUNK.NAME) is one of VISSL's",
       "implemented: mlp, regnet, resnet"), tool=False),
    # VISSL's colorization input: no "did you mean 'PILToTensor'", which would train on RGB
    R("vissl-transform-not-implemented", ("config.DATA.TRAIN.TRANSFORMS=[{name:ImgPil2LabTensor},{name:ToTensor}]",),
      ("transform 'ImgPil2LabTensor' (config key config.DATA.TRAIN.TRANSFORMS[0].name) is one of VISSL's that "
       "ssl_engine does not implement", "@TRANSFORMS.register('ImgPil2LabTensor')"), tool=False),
    R("unknown-transform", ("config.DATA.TRAIN.TRANSFORMS=[{name:ToTensr}]",),
      ("unknown transform 'ToTensr'", "did you mean 'ToTensor'"), tool=False),
    R("unknown-engine", ("engine_name=trian",), ("unknown engine 'trian'", "known: extract_features, train"),
    tool=False),
    # VISSL's label-prediction engine (quick_extract_label_predictions.yaml): no "did you mean
    # 'extract_features'", which writes features, not predictions
    R("vissl-engine-not-implemented", ("engine_name=extract_label_predictions",),
      ("engine 'extract_label_predictions' (config key engine_name) is one of VISSL's that ssl_engine does not "
       "implement; implemented: extract_features, train", "@ENGINES.register('extract_label_predictions')"), tool=False),
    # a VISSL config of a method this engine lacks names several parts: all of them in one line
    R("unknown-parts-together", ("config.MODEL.HEAD.PARAMS=[[siamese_concat_view,{num_towers:9}]]",
                                 "config.DATA.TRAIN.COLLATE_FUNCTION=siamese_collator",
                                 "config.DATA.TRAIN.TRANSFORMS=[{name:ToTensor},{name:ShuffleImgPatches}]"),
      ("this config names 3 parts that are not registered",
       "head 'siamese_concat_view' (config.MODEL.HEAD.PARAMS[0][0]; one of VISSL's that ssl_engine does not implement)",
       "collator 'siamese_collator' (config.DATA.TRAIN.COLLATE_FUNCTION; one of VISSL's",
       "transform 'ShuffleImgPatches' (config.DATA.TRAIN.TRANSFORMS[1].name; one of VISSL's", "known heads: eval_mlp, mlp",
       "known collators:", "config.USER_MODULES"), tool=False),
    # one part named for both splits counts once, with both keys
    R("unknown-part-in-both-splits", ("config.TEST_MODEL=true", "config.DATA.TRAIN.DATA_SOURCES=[everstore]",
                                      "config.DATA.TEST.DATA_SOURCES=[everstore]", "config.LOSS.name=nce_loss_with_memory"),
      ("this config names 2 parts that are not registered",
       "loss 'nce_loss_with_memory' (config.LOSS.name; one of VISSL's that ssl_engine does not implement)",
       "data source 'everstore' (config.DATA.TRAIN.DATA_SOURCES[0], config.DATA.TEST.DATA_SOURCES[0]; one of VISSL's"),
      tool=False),
    R("vissl-data-source-in-both-splits", ("config.TEST_MODEL=true", "config.DATA.TRAIN.DATA_SOURCES=[everstore]",
                                           "config.DATA.TEST.DATA_SOURCES=[everstore]"),
      ("data source 'everstore' (config keys config.DATA.TRAIN.DATA_SOURCES[0], config.DATA.TEST.DATA_SOURCES[0]) is "
       "one of VISSL's that ssl_engine does not implement; implemented: digits, disk_filelist, disk_folder,",),
      tool=False),
    # VISSL's own PIRL file: heads in stages, and a key its defaults lack in the options of a loss
    # this engine lacks (VISSL takes such yaml keys): the one line names every missing part
    R("vissl-method-with-staged-heads", ("config={fx}/pirl_like.yaml", "config.MODEL.HEAD.PARAMS=[[[mlp,{dims:[16,8]}],"
                                         "[siamese_concat_view,{num_towers:9}]],[[mlp,{dims:[16,8]}]]]"),
      ("this config names 2 parts that are not registered", "head 'siamese_concat_view' (config.MODEL.HEAD.PARAMS[0][1][0]; one of VISSL's",
       "loss 'nce_loss_with_memory' (config.LOSS.name; one of VISSL's", "known losses: CrossEntropyLoss"), tool=False),
    # VISSL acts on it (the head trains on res4); accepted and not acted on, the run trained on the last layer
    R("head-mapping-not-implemented", ("config.MODEL.MULTI_INPUT_HEAD_MAPPING=[[data,[res4]]]",),
      ("config.MODEL.MULTI_INPUT_HEAD_MAPPING=[['data', ['res4']]]", "is not implemented",
       "~config.MODEL.MULTI_INPUT_HEAD_MAPPING")),
    R("pre-release-linear-evaluation", ("config={fx}/pre_release_linear.yaml",),
      ("config.MODEL.FEATURE_EVAL_MODE is the feature-evaluation switch of VISSL's pre-release layout",
       "config.MODEL.FEATURE_EVAL_SETTINGS", "config.MODEL.WEIGHTS_INIT.PARAMS_FILE", "starts from its random init")),
    # -- data ---------------------------------------------------------------------------------------
    R("missing-data-paths", ("config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"),
      ("config.DATA.TRAIN.DATA_PATHS", "disk_folder")),
    R("data-path-not-there", ("config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/nofolder]",
                              "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "{fx}/nofolder", "does not exist"), tool=False),
    R("empty-data-folder", ("config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/empty]",
                            "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "{fx}/empty", "contains no images"), tool=False),
    R("empty-class-folder", ("config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/images_empty_class]",
                             "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "1 class folder(s) of '{fx}/images_empty_class' hold no images: 'zz_empty'",
       "put images in them", "removing one renumbers the classes after it"), tool=False),
    R("labels-do-not-match-data", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                                   "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                                   "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                                   "config.DATA.TRAIN.LABEL_PATHS=[{fx}/labels5.npy]", "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("config.DATA.TRAIN.LABEL_PATHS[0]", "{fx}/labels5.npy", "has 5 labels", "has 6 samples")),
    R("filelist-with-folder-labels", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                                      "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                                      "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("config.DATA.TRAIN.LABEL_SOURCES[0]=disk_folder reads its labels from config.DATA.TRAIN.DATA_PATHS[0]",
       "(DATA_SOURCES[0] is disk_filelist)", "is not a folder",
       "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist] with config.DATA.TRAIN.LABEL_PATHS="), tool=False),
    R("both-splits-missing-paths", ("config.TEST_MODEL=true", "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                                    "config.DATA.TRAIN.DATA_PATHS=[{fx}/no_train]", "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
                                    "config.DATA.TEST.DATA_PATHS=[{fx}/no_test]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]: '{fx}/no_train' does not exist; and config.DATA.TEST.DATA_PATHS[0]: "
       "'{fx}/no_test' does not exist",), tool=False),
    R("both-splits-empty-folders", ("config.TEST_MODEL=true", "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                                    "config.DATA.TRAIN.DATA_PATHS=[{fx}/empty]", "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
                                    "config.DATA.TEST.DATA_PATHS=[{fx}/empty]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]: folder '{fx}/empty' contains no images",
       "; and config.DATA.TEST.DATA_PATHS[0]: folder '{fx}/empty' contains no images"), tool=False),
    R("best-metric-typo", ("config.TEST_MODEL=true", "config.DATA.TEST.DATA_LIMIT=8",
                           "config.HOOKS.BEST_CHECKPOINT.METRIC=test_accuracy_list_meter/top_9/0"),
      ("config.HOOKS.BEST_CHECKPOINT.METRIC='test_accuracy_list_meter/top_9/0' is not a value of the meter "
       "config.METERS.accuracy_list_meter", "test_accuracy_list_meter/top_1/0"), tool=False),
    R("best-metric-without-test-phases", ("config.HOOKS.BEST_CHECKPOINT.METRIC=test_loss",),
      ("config.HOOKS.BEST_CHECKPOINT.METRIC='test_loss' is a test metric, but this run has no test phase "
       "(config.TEST_MODEL=false, config.TEST_ONLY=false)",), tool=False),
    # a loss with one class per output row, and a split that gives the model several inputs per
    # sample (the model puts them one after the other in the batch): refused before launch, naming
    # where the inputs come from, instead of the loss's shape error at the first step
    R("two-data-sources-one-label", ("config.DATA.TRAIN.DATA_SOURCES=[disk_folder,disk_folder]",
                                     "config.DATA.TRAIN.DATA_PATHS=[{fx}/images,{fx}/images]",
                                     "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("config.DATA.TRAIN gives the model 2 inputs per sample and one label",
       "config.LOSS.name=cross_entropy_multiple_output_single_target, which needs a label per output row",
       "DATA_SOURCES=['disk_folder', 'disk_folder'] (one input per data source")),
    R("two-label-sources", ("config.DATA.TRAIN.DATA_SOURCES=[disk_folder,disk_folder]",
                            "config.DATA.TRAIN.DATA_PATHS=[{fx}/images,{fx}/images]",
                            "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder,disk_folder]", "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("config.DATA.TRAIN.LABEL_SOURCES=['disk_folder', 'disk_folder'] gives 2 labels per sample",
       "takes one: name one label source"), tool=False),
    R("replicated-views-one-label", ("config.DATA.TRAIN.TRANSFORMS=[{name:ImgReplicatePil,num_times:2},"
                                     "{name:Resize,size:[32,32]},{name:ToTensor}]",),
      ("config.DATA.TRAIN gives the model 2 inputs per sample and one label",
       "config.DATA.TRAIN.TRANSFORMS / COLLATE_FUNCTION (views made by ImgReplicatePil"), tool=False),
    # the TEST split is read in order: a batch of it holding only ignored labels is known before launch
    # (its loss is NaN: the run would stop there after a whole train phase)
    R("test-batch-all-ignored", ("config.TEST_MODEL=true", "config.DATA.TEST.DATA_SOURCES=[disk_filelist]",
                                 "config.DATA.TEST.DATA_PATHS=[{fx}/images.npy]", "config.DATA.TEST.LABEL_SOURCES=[disk_filelist]",
                                 "config.DATA.TEST.LABEL_PATHS=[{fx}/labels_unlabelled_first.npy]",
                                 "config.DATA.TEST.DATA_LIMIT=-1", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=3",
                                 "config.DATA.TEST.TRANSFORMS=[{name:Resize,size:[32,32]},{name:ToTensor}]"),
      ("config.DATA.TEST: batch 1 (samples 0, 1, 2 of the TEST data, read in order) holds only the label -1",
       "config.LOSS.name=cross_entropy_multiple_output_single_target ignores", "place them among labelled ones"),
      tool=False),
    R("labels-all-ignored", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                             "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                             "config.DATA.TRAIN.LABEL_PATHS=[{fx}/labels_unlabelled.npy]", "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("config.DATA.TRAIN: every label", "is -1", "ignore_index", "give the samples their class labels"), tool=False),
    R("labels-all-ignored-sum-loss", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                                      "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                                      "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                                      "config.DATA.TRAIN.LABEL_PATHS=[{fx}/labels_unlabelled.npy]",
                                      "config.DATA.TRAIN.DATA_LIMIT=-1",
                                      "config.LOSS.cross_entropy_multiple_output_single_target.reduction=sum"),
      ("config.DATA.TRAIN: every label", "is -1", "sum over no sample (0): nothing would train"), tool=False),
    R("labels-fractional", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                            "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                            "config.DATA.TRAIN.LABEL_PATHS=[{fx}/labels_half.npy]", "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("config.DATA.TRAIN.LABEL_PATHS[0]", "{fx}/labels_half.npy", "the label 0.5 at index 1", "integer class indices"),
      tool=False),
    R("labels-float-beyond-head", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                                   "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                                   "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                                   "config.DATA.TRAIN.LABEL_PATHS=[{fx}/labels_float100.npy]",
                                   "config.DATA.TRAIN.DATA_LIMIT=-1"),
      ("MODEL.HEAD.PARAMS[0] (mlp)", "outputs 10 classes", "has label 100", "at least 101 classes"), tool=False),
    R("data-list-empty-file", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/empty.npy]",
                               "config.DATA.TRAIN.LABEL_SOURCES=[]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "{fx}/empty.npy", "is empty (0 bytes)", "a .txt list, one per line"),
      tool=False),
    R("data-list-not-utf8", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/latin1.txt]",
                             "config.DATA.TRAIN.LABEL_SOURCES=[]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "{fx}/latin1.txt", "caf\\udce9.png", "does not exist",
       "not UTF-8: byte 0xe9"), tool=False),
    R("data-list-is-a-folder", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/images]",
                                "config.DATA.TRAIN.LABEL_SOURCES=[]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "{fx}/images' is a folder", "a .npy or .txt file listing image paths",
       "disk_folder source in config.DATA.TRAIN.DATA_SOURCES"), tool=False),
    R("data-list-truncated", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                              "config.DATA.TRAIN.DATA_PATHS=[{fx}/images_truncated.npy]", "config.DATA.TRAIN.LABEL_SOURCES=[]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]", "{fx}/images_truncated.npy' is truncated or corrupt", "shape (6,)"),
      tool=False),
    R("tv-dataset-folder-missing", TV_CIFAR + ("config.DATA.TRAIN.DATA_PATHS=[{fx}/nocifar]",),
      ("config.DATA.TRAIN.DATA_PATHS[0]: '{fx}/nocifar' does not exist", "cifar-10-batches-py/data_batch_1, ",
       "never downloads", "torchvision.datasets.CIFAR10('{fx}/nocifar', train=True, download=True)")),
    R("tv-dataset-unknown-name", TV_CIFAR + ("config.DATA.TRAIN.DATA_PATHS=[{fx}/cifar]",
                                             "config.DATA.TRAIN.DATASET_NAMES=[CIFAR11]"),
      ("config.DATA.TRAIN.DATASET_NAMES[0]='CIFAR11' is not a data set the torchvision_dataset source reads",
       "valid: CIFAR10, CIFAR100, MNIST, STL10, SVHN")),
    R("tv-dataset-truncated-file", TV_CIFAR + ("config.DATA.TRAIN.DATA_PATHS=[{fx}/cifar_truncated]",),
      ("config.DATA.TRAIN.DATA_PATHS[0]: CIFAR10 file '{fx}/cifar_truncated/cifar-10-batches-py/data_batch_2' is "
       "truncated or corrupt", "fetch the data again")),
    R("loss-needs-labels-none-given", ("config.DATA.TRAIN.LABEL_SOURCES=[]",),
      ("config.LOSS.name=cross_entropy_multiple_output_single_target", "config.DATA.TRAIN.LABEL_SOURCES is empty",
       "LABEL_TYPE=sample_index")),
    R("test-meter-needs-labels-none-given", ("config.TEST_MODEL=true", "config.DATA.TEST.LABEL_SOURCES=[]"),
      ("the meter accuracy_list_meter", "config.DATA.TEST.LABEL_SOURCES is empty"), tool=False),
    R("dataset-smaller-than-a-batch", ("config.DATA.TRAIN.DROP_LAST=true", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=64"),
      ("config.DATA.TRAIN.DROP_LAST", "32 samples", "BATCHSIZE_PER_REPLICA=64")),
    # found before launch, not after the first train phase: the TEST split's collator takes its first sample
    R("test-transforms-without-to-tensor", ("config.TEST_MODEL=true", "config.DATA.TEST.DATA_LIMIT=8",
                                            "config.DATA.TEST.TRANSFORMS=[{name:Resize,size:32}]"),
      ("cannot batch data entry 0: got a Image, not a tensor", "end config.DATA.TEST.TRANSFORMS with ToTensor")),
    R("bad-transform-params", ("config.DATA.TRAIN.TRANSFORMS=[{name:RandomResizedCrop,sizee:32}]",),
      ("config.DATA.TRAIN.TRANSFORMS[0]", "RandomResizedCrop", "sizee"), tool=False),
    # VISSL's fulltune configs give Pillow's filter code (interpolation: 3); one out of range was a KeyError traceback
    R("transform-interpolation-code", ("+config.DATA.TRAIN.TRANSFORMS.0.interpolation=9",),
      ("config.DATA.TRAIN.TRANSFORMS[0]: unknown interpolation 9", "bicubic", "3 (bicubic)")),
    # a yaml list where the transform's constructor wants a tensor was an AttributeError traceback in the rank
    R("transform-param-not-a-tensor", ("config.DATA.TRAIN.TRANSFORMS=[{name:LinearTransformation,"
                                       "transformation_matrix:[[1]],mean_vector:[0]}]",),
      ("config.DATA.TRAIN.TRANSFORMS[0]", "bad parameters for transform 'LinearTransformation'", "no attribute")),
    # -- model, optimizer ---------------------------------------------------------------------------
    R("head-input-dim-mismatch", ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[64,10]}]]",),
      ("MODEL.HEAD.PARAMS[0]", "dims[0]=64", "gives 16 features")),
    # a quoted "false" is a non-empty string, true to Python: the head was built with BatchNorm, silently
    R("head-switch-not-a-bool", ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10],use_bn:'false'}]]",),
      ("config.MODEL.HEAD.PARAMS[0] (mlp): use_bn='false' must be true or false",), folder="fresh"),
    R("head-fewer-classes-than-labels", ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,2]}]]",),
      ("MODEL.HEAD.PARAMS[0] (mlp)", "outputs 2 classes", "config.DATA.TRAIN has label 9", "at least 10 classes")),
    R("head-fewer-classes-than-class-folders", ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,1]}]]",
                                                "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                                                "config.DATA.TRAIN.DATA_PATHS=[{fx}/images]",
                                                "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"),
      ("MODEL.HEAD.PARAMS[0] (mlp)", "outputs 1 class ", "has label 1", "['disk_folder']", "at least 2 classes"),
      tool=False),
    R("test-meter-fewer-classes-than-labels", ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,4]}]]",
                                               "config.LOSS.name=simclr_info_nce_loss", "config.TEST_MODEL=true",
                                               "config.LOSS.simclr_info_nce_loss.buffer_params.embedding_dim=4",
                                               "config.METERS.enable_training_meter=false"),
      ("MODEL.HEAD.PARAMS[0] (mlp)", "the meter config.METERS.accuracy_list_meter", "outputs 4 classes",
       "config.DATA.TEST has label 9"), tool=False),
    R("meters-more-than-model-outputs", ("config.METERS.accuracy_list_meter.num_meters=2",),
      ("config.METERS.accuracy_list_meter.num_meters=2", "the model returns 1 output", "set num_meters to 1"),
      folder="fresh"),
    R("linear-eval-meters-fewer-than-heads", ("config.MODEL.TRUNK.MLP.DIMS=[3072,16,16]",
                                              "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
                                              "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP="
                                              "[[fc1,[Identity,[]]],[fc2,[Identity,[]]]]",
                                              "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}],[mlp,{dims:[16,10]}]]"),
      ("config.METERS.accuracy_list_meter.num_meters=1", "the model returns 2 outputs", "set num_meters to 2"),
      folder="fresh", tool=False),
    R("meter-topk-beyond-classes", ("config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,2]}]]",
                                    "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_PATHS=[{fx}/images]",
                                    "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"),
      ("config.METERS.accuracy_list_meter.topk_values=[1, 5]", "top-5 needs at least 5 classes",
       "the model outputs 2"), folder="fresh", tool=False),
    R("test-only-meter-topk-beyond-classes", ("config.TEST_ONLY=true", "config.TEST_MODEL=true",
                                              "config.METERS.accuracy_list_meter.topk_values=[1,11]"),
      ("config.METERS.accuracy_list_meter.topk_values=[1, 11]", "top-11 needs at least 11 classes",
       "the model outputs 10"), folder="fresh", tool=False),
    R("nothing-to-train-trunk-and-heads-frozen", ("config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
                                                  "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD=true"),
      ("no trainable parameters", "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_AND_HEAD=true",
       "--engine=extract_features", "tools/nearest_neighbor_test.py"), folder="fresh", tool=False),
    R("nothing-to-train-frozen-trunk-no-head", ("config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
                                                "config.MODEL.FEATURE_EVAL_SETTINGS.FREEZE_TRUNK_ONLY=true",
                                                "config.MODEL.HEAD.PARAMS=[]", "config.LOSS.name=simclr_info_nce_loss",
                                                "config.METERS.names=[]"),
      ("no trainable parameters", "FREEZE_TRUNK_ONLY=true freezes the trunk", "config.MODEL.HEAD.PARAMS gives no head"),
      folder="fresh", tool=False),
    # -- settings of optional hooks and parts, refused before launch (they were refused by the rank,
    #    or not at all: 0 PreciseBN batches zeroed every BatchNorm, a negative clip norm trained uphill)
    R("precise-bn-zero-batches", ("config.HOOKS.PRECISE_BN.USE_PRECISE_BN=true", "config.HOOKS.PRECISE_BN.NUM_ITERATIONS=0"),
      ("config.HOOKS.PRECISE_BN.NUM_ITERATIONS=0", "an integer >= 1"), folder="fresh", tool=False),
    R("grad-clip-negative-norm", ("config.MODEL.GRAD_CLIP.USE_GRAD_CLIP=true", "config.MODEL.GRAD_CLIP.MAX_NORM=-1"),
      ("config.MODEL.GRAD_CLIP.MAX_NORM=-1.0", "a number > 0"), folder="fresh", tool=False),
    R("grad-clip-zero-norm-type", ("config.MODEL.GRAD_CLIP.NORM_TYPE=0",),
      ("config.MODEL.GRAD_CLIP.NORM_TYPE=0.0", "or inf"), folder="fresh", tool=False),
    R("ce-reduction-none", ("config.LOSS.name=cross_entropy_multiple_output_single_target",
                            "config.LOSS.cross_entropy_multiple_output_single_target.reduction=none"),
      ("config.LOSS.cross_entropy_multiple_output_single_target.reduction='none'", "use mean (the default) or sum"),
      folder="fresh", tool=False),
    R("ce-weight-per-class-count", ("config.LOSS.name=cross_entropy_multiple_output_single_target",
                                    "config.LOSS.cross_entropy_multiple_output_single_target.weight=[1.0,2.0]"),
      ("config.LOSS.cross_entropy_multiple_output_single_target.weight has 2 entries", "scores 10 classes"),
      folder="fresh", tool=False),
    # a yaml string, or entries that are not numbers >= 0: a ValueError traceback in the rank (exit 1),
    # or, for a negative weight, a run that trained that class away from its label
    R("ce-weight-not-a-list", ('config.LOSS.cross_entropy_multiple_output_single_target.weight="1,2"',),
      ("config.LOSS.cross_entropy_multiple_output_single_target.weight='1,2' is not a list",
       "one number >= 0 per class", "null for equal weights"), folder="fresh"),
    R("ce-weight-negative", ("config.LOSS.cross_entropy_multiple_output_single_target.weight=[1,1,1,-1,1,1,1,1,1,1]",),
      ("config.LOSS.cross_entropy_multiple_output_single_target.weight[3]=-1 is not a finite number >= 0",),
      folder="fresh", tool=False),
    R("ema-decay-above-one", ("config.HOOKS.EMA_MODEL.SAVE_EMA_MODEL=true", "config.HOOKS.EMA_MODEL.DECAY=1.5"),
      ("config.HOOKS.EMA_MODEL.DECAY=1.5", "[0, 1]"), folder="fresh", tool=False),
    R("ema-update-every-zero", ("config.HOOKS.EMA_MODEL.SAVE_EMA_MODEL=true", "config.HOOKS.EMA_MODEL.UPDATE_ITER=0"),
      ("config.HOOKS.EMA_MODEL.UPDATE_ITER=0", ">= 1"), folder="fresh", tool=False),
    R("best-checkpoint-mode", ("config.HOOKS.BEST_CHECKPOINT.METRIC=train_loss", "config.HOOKS.BEST_CHECKPOINT.MODE=maximum"),
      ("config.HOOKS.BEST_CHECKPOINT.MODE='maximum'", "use max or min"), folder="fresh", tool=False),
    R("complexity-input-shape", ("config.HOOKS.MODEL_COMPLEXITY.COMPUTE_COMPLEXITY=true",
                                 "config.HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE=[3,-32,32]"),
      ("config.HOOKS.MODEL_COMPLEXITY.INPUT_SHAPE=[3, -32, 32]", "positive integers"), folder="fresh", tool=False),
    R("custom-hook-priority", ("config.HOOKS.CUSTOM=[{name:PreciseBNHook,priority:SUPER}]",),
      ("config.HOOKS.CUSTOM[0].priority='SUPER'", "VERY_HIGH"), folder="fresh", tool=False),
    R("distributed-backend", ("config.DISTRIBUTED.BACKEND=mpi",),
      ("config.DISTRIBUTED.BACKEND='mpi'", "one of nccl, gloo"), folder="fresh", tool=False),
    R("transform-setting-fails-on-an-image", ("config.DATA.TRAIN.TRANSFORMS.0.size=-5",),
      ("config.DATA.TRAIN.TRANSFORMS[0] (RandomResizedCrop with size=-5", "check its settings"), folder="fresh"),
    # one more than this machine's limit, max(64, 8 x CPUs) (within the absolute 1024 up to 127 CPUs)
    R("loader-workers-beyond-this-machine", (f"config.DATA.NUM_DATALOADER_WORKERS={WORKERS_BEYOND}",),
      (f"config.DATA.NUM_DATALOADER_WORKERS={WORKERS_BEYOND} is more loader workers per rank than this machine",),
      folder="fresh", tool=False),
    R("config-group-with-dot-dot", ("+config/../../elsewhere=case",),
      ("+config/../../elsewhere=case: a config group is a folder of the config search path, without '..'",
       "config=/path/to/file.yaml"), folder="fresh", tool=False),
    R("top-level-key-added-with-plus", ("+LOG_FREQUENCY=1",),
      ("'LOG_FREQUENCY' is not a top-level key", "did you mean config.LOG_FREQUENCY=...?"), folder="fresh"),
    R("unknown-lr-schedule", ("config.OPTIMIZER.param_schedulers.lr.name=cosin",),
      ("config.OPTIMIZER.param_schedulers.lr.name='cosin'", "cosine"), tool=False),
    # -- files: weights, checkpoints, folders, user modules ------------------------------------------
    R("weights-file-missing", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/nothere.torch",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE", "{fx}/nothere.torch", "does not exist"), folder="fresh", tool=False),
    R("weights-file-is-a-folder", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/images",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE", "{fx}/images is a folder; name a checkpoint file"), folder="fresh",
      tool=False),
    R("weights-file-no-expected-keys", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/foreign.torch",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE", "{fx}/foreign.torch", "match"), folder="fresh"),
    R("weights-file-pickle-payload", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/payload.torch",),
      ("refused to load {fx}/payload.torch",), folder="fresh", tool=False),
    R("resume-from-not-a-checkpoint", ("config.CHECKPOINT.RESUME_FROM={fx}/foreign.torch",),
      ("config.CHECKPOINT.RESUME_FROM", "{fx}/foreign.torch", "not an ssl_engine", "WEIGHTS_INIT"), tool=False),
    R("resume-from-pickle-payload", ("config.CHECKPOINT.RESUME_FROM={fx}/payload.torch",),
      ("refused to load {fx}/payload.torch",)),
    R("resume-from-missing", ("config.CHECKPOINT.RESUME_FROM={fx}/nothere.torch",),
      ("config.CHECKPOINT.RESUME_FROM", "{fx}/nothere.torch", "does not exist"), tool=False),
    R("resume-from-truncated", ("config.CHECKPOINT.RESUME_FROM={fx}/truncated.torch",),
      ("config.CHECKPOINT.RESUME_FROM: checkpoint {fx}/truncated.torch is truncated or corrupt",), tool=False),
    # a TorchScript archive (torch.jit.save): torch.load printed two warnings and the line said
    # "is truncated or corrupt: its zip archive cannot be read", which it is not
    R("resume-from-torchscript", ("config.CHECKPOINT.RESUME_FROM={fx}/scripted.pt",),
      ("config.CHECKPOINT.RESUME_FROM: checkpoint {fx}/scripted.pt is a TorchScript archive (torch.jit.save)",
       "torch.save(model.state_dict(), path)")),
    R("weights-file-torchscript", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/scripted.pt",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE: checkpoint {fx}/scripted.pt is a TorchScript archive",), folder="fresh",
      tool=False),
    # np.savez's .npz is a zip too: the line said "truncated or corrupt: its zip archive cannot be read"
    R("weights-file-npz", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/weights.npz",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE: checkpoint {fx}/weights.npz is a zip archive that torch.save did not "
       "write (it holds 'fc.npy'", "save the weights with torch.save"), folder="fresh"),
    R("resume-from-a-device", ("config.CHECKPOINT.RESUME_FROM=/dev/null",),
      ("config.CHECKPOINT.RESUME_FROM: '/dev/null' is a character device; name a checkpoint file",), tool=False),
    R("resume-from-a-link-loop", ("config.CHECKPOINT.RESUME_FROM={fx}/loop.torch",),
      ("config.CHECKPOINT.RESUME_FROM: '{fx}/loop.torch' is a symbolic link that leads to no file",), tool=False),
    R("resume-from-a-folder", ("config.CHECKPOINT.RESUME_FROM={fx}",),
      ("config.CHECKPOINT.RESUME_FROM", "{fx} is a folder; name a checkpoint file"), tool=False),
    # -- URLs where a local path belongs: the key and the URL as given, no download ------------------
    R("url-weights-file", (f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={ZOO_URL}",),
      (f"error: config.MODEL.WEIGHTS_INIT.PARAMS_FILE: {ZOO_URL} is a URL; ssl_engine does not download files "
       "(no network access at run time): fetch it first", "set config.MODEL.WEIGHTS_INIT.PARAMS_FILE to the local path"),
      folder="fresh"),
    R("url-resume-from", ("config.CHECKPOINT.RESUME_FROM=https://example.org/run/checkpoint.torch",),
      ("config.CHECKPOINT.RESUME_FROM: https://example.org/run/checkpoint.torch is a URL", "does not download"),
      tool=False),
    R("url-data-path", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                        "config.DATA.TRAIN.DATA_PATHS=[s3://bucket/images.npy]",
                        "config.DATA.TRAIN.LABEL_PATHS=[{fx}/labels5.npy]"),
      ("config.DATA.TRAIN.DATA_PATHS[0]: s3://bucket/images.npy is a URL", "fetch it first"), tool=False),
    R("url-label-path", ("config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]", "config.DATA.TRAIN.LABEL_SOURCES=[disk_filelist]",
                         "config.DATA.TRAIN.DATA_PATHS=[{fx}/images.npy]",
                         "config.DATA.TRAIN.LABEL_PATHS=[http://example.org/labels.npy]"),
      ("config.DATA.TRAIN.LABEL_PATHS[0]: http://example.org/labels.npy is a URL",), tool=False),
    R("weights-file-not-torch", ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE={fx}/garbage.torch",),
      ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE: checkpoint {fx}/garbage.torch is not a file written by torch.save (it starts with b'not a ch",), folder="fresh",
      tool=False),
    R("checkpoint-dir-is-a-file", ("config.CHECKPOINT.DIR={fx}/garbage.torch",),
      ("config.CHECKPOINT.DIR={fx}/garbage.torch is a file",), tool=False),
    # folders of optional hooks: found at the hook's first write, after the run had written log.txt and
    # train_config.yaml into its folder, in a line that named no key
    R("tensorboard-log-dir-under-a-file", ("config.HOOKS.TENSORBOARD_SETUP.USE_TENSORBOARD=true",
                                          "config.HOOKS.TENSORBOARD_SETUP.LOG_DIR={fx}/garbage.torch/tb"),
      ("config.HOOKS.TENSORBOARD_SETUP.LOG_DIR={fx}/garbage.torch/tb (its folder {fx}/garbage.torch/tb/tensorboard/tb_logs)",
       "cannot be created: {fx}/garbage.torch is a file"), folder="fresh"),
    R("profiler-output-folder-under-a-file", ("config.PROFILING.RUNTIME_PROFILING.USE_PROFILER=true",
                                              "config.PROFILING.OUTPUT_FOLDER={fx}/garbage.torch/prof"),
      ("config.PROFILING.OUTPUT_FOLDER={fx}/garbage.torch/prof (its folder", "{fx}/garbage.torch is a file"),
      folder="fresh", tool=False),
    R("user-module-missing", ("config.USER_MODULES=[{fx}/my_parts.py]",),
      ("config.USER_MODULES", "{fx}/my_parts.py", "does not exist")),
    R("two-ranks-head-mismatch", ("config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[8,10]}]]"),
      ("dims[0]=8", "gives 16 features"), tool=False),
]


class Payload:
    """Unpickling this creates a marker file; no loader may ever do it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def make_fixture_files(fx: Path) -> None:
    fx.mkdir(parents=True, exist_ok=True)
    (fx / "unknown_key.yaml").write_text("# @package _global_\nconfig:\n  OPTIMIZER:\n    num_epoch: 3\n")
    (fx / "malformed.yaml").write_text("# @package _global_\nconfig:\n  DATA:\n    TRAIN: [digits\n  LOG_FREQUENCY: 3\n")
    (fx / "python_tag.yaml").write_text(
        f"# @package _global_\nconfig:\n  LOG_FREQUENCY: !!python/object/apply:os.system ['touch {fx}/PWNED']\n"
    )
    (fx / "a_list.yaml").write_text("- config\n- LOG_FREQUENCY\n")
    (fx / "experiment").write_text("# @package _global_\nconfig:\n  LOG_FREQUENCY: 3\n")
    (fx / "pirl_like.yaml").write_text(
        "# @package _global_\nconfig:\n  MODEL:\n    MULTI_INPUT_HEAD_MAPPING: [[patches, [flatten]], [images, [flatten]]]\n"
        "  LOSS:\n    name: nce_loss_with_memory\n    nce_loss_with_memory:\n      ignore_index: -1\n"
        "      temperature: 0.07\n"
    )
    (fx / "pre_release_linear.yaml").write_text(  # VISSL's other_styles/eval_resnet_final_output layout
        "# @package _global_\nconfig:\n  MODEL:\n    FEATURE_EVAL_MODE: True\n    EVAL_FEATURES: [res5avg]\n"
        "    PARAMS_FILE:\n      PATH: /models/rn50.torch\n"
    )
    (fx / "skip_layers_null.yaml").write_text(
        "# @package _global_\ndefaults: [/config/quick/supervised_digits, _self_]\nconfig:\n  MODEL:\n"
        "    WEIGHTS_INIT:\n      SKIP_LAYERS: [true]\n"
    )
    (fx / "collate_params_list.yaml").write_text(
        "# @package _global_\nconfig:\n  DATA:\n    TRAIN:\n      COLLATE_FUNCTION_PARAMS: [1]\n"
    )
    (fx / "null_key.yaml").write_text("# @package _global_\nconfig:\n  DATA:\n    TRAIN:\n      null: 3\n")
    (fx / "tree" / "config" / "parts").mkdir(parents=True, exist_ok=True)
    (fx / "tree" / "config" / "exp").mkdir(parents=True, exist_ok=True)
    (fx / "tree" / "config" / "parts" / "data_list.yaml").write_text("# @package _global_\nconfig:\n  DATA: [1]\n")
    (fx / "tree" / "config" / "parts" / "null_key.yaml").write_text("# @package _global_\nconfig:\n  null: 1\n")
    for name, part in (("uses_parts", "data_list"), ("uses_null_key", "null_key")):
        (fx / "tree" / "config" / "exp" / f"{name}.yaml").write_text(
            f"# @package _global_\ndefaults: [/config/quick/supervised_digits, /config/parts/{part}, _self_]\n"
            "config:\n  LOG_FREQUENCY: 3\n"
        )
    (fx / "placeholder.yaml").write_text(
        "# @package _global_\ndefaults: [/config/quick/supervised_digits, _self_]\nconfig:\n  MODEL:\n"
        "    WEIGHTS_INIT:\n      PARAMS_FILE: ???\n"
    )
    (fx / "duplicate.yaml").write_text("# @package _global_\nconfig:\n  LOG_FREQUENCY: 3\n  LOG_FREQUENCY: 4\n")
    (fx / "empty").mkdir(exist_ok=True)
    from PIL import Image

    rng = np.random.RandomState(0)
    paths = []
    for cls in ("a", "b"):
        (fx / "images" / cls).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            p = fx / "images" / cls / f"{i}.png"
            Image.fromarray(rng.randint(0, 255, (8, 8, 3), dtype=np.uint8)).save(p)
            paths.append(str(p))
    np.save(fx / "images.npy", np.array(paths))
    shutil.copytree(fx / "images", fx / "images_empty_class")
    (fx / "images_empty_class" / "zz_empty").mkdir()
    (fx / "images_truncated.npy").write_bytes((fx / "images.npy").read_bytes()[:-30])
    np.save(fx / "labels5.npy", np.arange(5))
    (fx / "empty.npy").write_bytes(b"")
    (fx / "latin1.txt").write_bytes(b"/nowhere/caf\xe9.png\n")
    torch.save({"phase_idx": 0, "classy_state_dict": {}}, fx / "whole.torch")
    (fx / "truncated.torch").write_bytes((fx / "whole.torch").read_bytes()[:200])
    if not (fx / "loop.torch").is_symlink():
        (fx / "loop.torch").symlink_to(fx / "loop.torch")
    np.save(fx / "labels_unlabelled.npy", np.full(6, -1))  # VISSL's label of an unlabelled image, on every one
    np.save(fx / "labels_unlabelled_first.npy", np.array([-1, -1, -1, 0, 1, 0]))  # a TEST batch of 3 with none labelled
    np.save(fx / "labels_half.npy", np.array([0.0, 0.5, 1.0, 1.0, 0.0, 1.0]))
    np.save(fx / "labels_float100.npy", np.array([0.0, 1.0, 100.0, 1.0, 0.0, 1.0]))
    torch.save({"foo": torch.zeros(3), "bar": {"baz": torch.ones(2)}}, fx / "foreign.torch")
    torch.save({"phase_idx": 0, "classy_state_dict": {"base_model": Payload(str(fx / "PWNED"))}}, fx / "payload.torch")
    (fx / "garbage.torch").write_bytes(b"not a checkpoint")
    np.savez(fx / "weights.npz", fc=np.zeros(3))
    with warnings.catch_warnings():  # torch.jit.script / save are deprecated: the files they wrote are still about
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Linear(3, 4)), str(fx / "scripted.pt"))
    write_dataset("CIFAR10", fx / "cifar", n_train=10, n_test=4)
    shutil.copytree(fx / "cifar", fx / "cifar_truncated")
    batch = fx / "cifar_truncated" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:1000])


def folder_hashes(folder: Path) -> Dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Dict[str, Path]:
    """Fixture files, a run folder whose training stopped after phase 0, and a fresh folder."""
    root = tmp_path_factory.mktemp("bad_input")
    make_fixture_files(root / "fx")
    run = root / "run"
    done = run_tool(BASE + [f"config.CHECKPOINT.DIR={run}"])
    assert done.returncode == 0, done.stderr[-3000:]
    # make it a run interrupted after phase 0: the final checkpoint goes, the pointer goes back
    for p in run.glob("model_final_checkpoint_phase*.torch"):
        p.unlink()
    ck.point_to(run, "model_phase0.torch")
    fresh = root / "fresh"
    fresh.mkdir()
    (fresh / "notes.txt").write_text("a folder the user made for the run\n")
    return {"root": root, "fx": root / "fx", "run": run, "fresh": fresh}


def _fill(text: str, places: Dict[str, Path]) -> str:
    return text.replace("{fx}", str(places["fx"]))


def _run_row(row: Row, places: Dict[str, Path]) -> dict:
    folder = places["root"] / "rows" / row.id
    shutil.copytree(places[row.folder], folder, symlinks=True)
    before = folder_hashes(folder)
    args = BASE + [f"config.CHECKPOINT.DIR={folder}"] + [_fill(a, places) for a in row.args]
    proc = run_tool(args, timeout=240)
    return {"proc": proc, "folder": folder, "before": before, "after": folder_hashes(folder)}


def main_in_process(args: List[str]) -> int:
    """The tool's main() in this process (no torch import per row); its console handlers are
    removed afterwards, so the next call logs only once."""
    from ssl_engine.cli import main

    try:
        return main(args)
    finally:
        for h in list(logging.getLogger().handlers):  # main() logs to the console it was given
            if getattr(h, "_ssl_engine", False):
                logging.getLogger().removeHandler(h)


def _run_row_in_process(row: Row, places: Dict[str, Path], capsys) -> dict:
    folder = places["root"] / "rows" / row.id
    shutil.copytree(places[row.folder], folder, symlinks=True)
    before = folder_hashes(folder)
    args = BASE + [f"config.CHECKPOINT.DIR={folder}"] + [_fill(a, places) for a in row.args]
    capsys.readouterr()
    code = main_in_process(args)
    out = capsys.readouterr()
    proc = subprocess.CompletedProcess(args, code, out.out, out.err)
    return {"proc": proc, "folder": folder, "before": before, "after": folder_hashes(folder)}


class _RowsRunOnDemand(dict):
    """Tool rows' results, each row run when its test first asks for it."""

    def __init__(self, places: Dict[str, Path]) -> None:
        super().__init__()
        self.places = places

    def __missing__(self, row_id: str) -> dict:
        row = next(r for r in ROWS if r.id == row_id)
        self[row_id] = got = _run_row(row, self.places)
        return got


@pytest.fixture(scope="module")
def results(folders, request) -> Dict[str, dict]:
    """The tool rows' results, by row id.

    Under pytest-xdist each row runs in its own test, so the workers share the rows out (a
    fixture that ran them all would run on every worker that gets a row: xdist_group does not
    keep tests together with pytest 9). In one process the rows selected run two at a time
    up front.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return _RowsRunOnDemand(folders)
    wanted = {item.callspec.params["row"].id for item in request.session.items
              if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("row"), Row)}
    rows = [r for r in ROWS if r.tool and (r.id in wanted or not wanted)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda r: _run_row(r, folders), rows))
    return {r.id: d for r, d in zip(rows, done)}


def test_the_table_is_big_enough():
    assert len({r.id for r in ROWS}) == len(ROWS)
    assert sum(r.tool for r in ROWS) >= 30  # rows that run the real tool in a subprocess


@pytest.mark.parametrize("row", ROWS, ids=[r.id + ("" if r.tool else "-main") for r in ROWS])
def test_bad_input_row(row: Row, results, folders, capsys):
    got = results[row.id] if row.tool else _run_row_in_process(row, folders, capsys)
    proc = got["proc"]
    err = proc.stderr.strip()
    assert proc.returncode == 2, f"exit {proc.returncode}\nstderr:\n{err[-3000:]}\nstdout:\n{proc.stdout[-2000:]}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line:\n{err[-3000:]}"
    assert "Traceback" not in err
    for text in row.must:
        assert _fill(text, folders) in lines[0], f"{_fill(text, folders)!r} not in {lines[0]!r}"
    assert got["after"] == got["before"], "the checkpoint folder changed"
    assert not (folders["fx"] / "PWNED").exists(), "a payload ran"


USER_HEAD = """
from torch import nn
from ssl_engine.registry import HEADS


@HEADS.register("opaque_linear")
class OpaqueLinear(nn.Module):
    \"\"\"A head whose output size the config does not show (no dims): only the run can check it.\"\"\"

    def __init__(self, model_config, size_in, size_out):
        super().__init__()
        self.fc = nn.Linear(size_in, size_out)

    def forward(self, x):
        return self.fc(x[0] if isinstance(x, (list, tuple)) else x)
"""


def test_a_label_beyond_a_heads_classes_found_by_the_run_is_one_line(tmp_path):
    """A head the pre-launch check cannot size: the first step's "Target 9 is out of bounds" is one
    line naming the head's key and the label, exit 2."""
    module = tmp_path / "user_head.py"
    module.write_text(USER_HEAD)
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]",
                            "config.MODEL.HEAD.PARAMS=[[opaque_linear,{size_in:16,size_out:3}]]"])
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    for text in ("MODEL.HEAD.PARAMS[0] (opaque_linear)", "outputs 3 classes", "config.DATA.TRAIN has label"):
        assert text in err, err


USER_TRUNK = """
from torch import nn
from ssl_engine.registry import TRUNKS


@TRUNKS.register("my_flat_trunk")
class MyFlatTrunk(nn.Module):
    \"\"\"A trunk of the user's own: its output size is known only by running it.\"\"\"

    def __init__(self, model_config, model_name):
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 24)

    def forward(self, x, out_feat_keys=None):
        return [self.fc(x.flatten(1))]
"""


def test_a_head_that_does_not_fit_a_trunk_of_your_own_is_refused_before_launch(tmp_path):
    """The pre-launch check runs the model on the meta device on the first sample's shape: a
    head sized for another trunk is one line, and the checkpoint folder is never created."""
    module = tmp_path / "user_trunk.py"
    module.write_text(USER_TRUNK)
    run = tmp_path / "run"
    args = BASE + [f"config.CHECKPOINT.DIR={run}", f"config.USER_MODULES=[{module}]", "config.MODEL.TRUNK.NAME=my_flat_trunk"]
    proc = run_tool(args + ["config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,10]}]]"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: config.MODEL.HEAD.PARAMS[0] (mlp) has dims[0]=16 but its input has 24 features per sample "
        "(shape [2, 24]); set dims[0] to 24"]
    assert not run.exists()
    proc = run_tool(args + ["config.MODEL.HEAD.PARAMS=[[mlp,{dims:[24,10]}]]"])
    assert proc.returncode == 0, proc.stderr[-3000:]


BAD_TRUNKS = """
from torch import nn
from ssl_engine.registry import TRUNKS


@TRUNKS.register("returns_a_tensor")
class ReturnsATensor(nn.Module):
    def __init__(self, model_config, model_name):
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 16)

    def forward(self, x, out_feat_keys=None):
        return self.fc(x.flatten(1))


@TRUNKS.register("returns_nothing")
class ReturnsNothing(ReturnsATensor):
    def forward(self, x, out_feat_keys=None):
        self.fc(x.flatten(1))


@TRUNKS.register("takes_only_the_config")
class TakesOnlyTheConfig(nn.Module):
    def __init__(self, model_config):
        super().__init__()


@TRUNKS.register("ignores_out_feat_keys")
class IgnoresOutFeatKeys(ReturnsATensor):
    def forward(self, x, out_feat_keys=None):
        return [self.fc(x.flatten(1))]
"""


@pytest.fixture(scope="module")
def bad_trunks(tmp_path_factory) -> Path:
    module = tmp_path_factory.mktemp("bad_trunks") / "bad_trunks_parts.py"
    module.write_text(BAD_TRUNKS)
    return module


@pytest.mark.parametrize("name, line, what", [
    ("returns_a_tensor", 6, "returned one tensor of shape [2, 16] from forward; a trunk returns a list of feature tensors"),
    ("returns_nothing", 16, "returned NoneType from forward; a trunk returns a list of feature tensors"),
    ("takes_only_the_config", 22, "cannot be built as TakesOnlyTheConfig(model_config, model_name): too many "
                                  "positional arguments"),
])
def test_a_trunk_of_your_own_that_breaks_its_contract_is_one_line_before_launch(tmp_path, capsys, bad_trunks, name,
                                                                                line, what):
    """A trunk whose forward returns a tensor (it was taken for a batch of rows and reported as a head
    of the wrong size), None (a TypeError traceback at the first step), or whose constructor does not
    take (model_config, model_name) (a traceback in the rank) is one line naming it, exit 2."""
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{bad_trunks}]",
                                   f"config.MODEL.TRUNK.NAME={name}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: trunk {name!r} (config.MODEL.TRUNK.NAME) ({bad_trunks} line {line}) "), err
    assert what in err, err
    assert not (tmp_path / "run").exists()


def test_features_of_layers_a_trunk_of_your_own_does_not_return_are_one_line(tmp_path, capsys, bad_trunks):
    """An extraction that maps two layers of a trunk that returns one tensor whatever out_feat_keys
    asks for wrote the first layer's features only and exited 0; it is one line, exit 2."""
    capsys.readouterr()
    code = main_in_process(BASE + [
        f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{bad_trunks}]", "--engine=extract_features",
        "config.MODEL.TRUNK.NAME=ignores_out_feat_keys", "config.MODEL.FEATURE_EVAL_SETTINGS.EVAL_MODE_ON=true",
        "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[fc,[Identity,[]]],[fc2,[Identity,[]]]]",
        "config.MODEL.HEAD.PARAMS=[]", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == (
        f"error: trunk 'ignores_out_feat_keys' (config.MODEL.TRUNK.NAME) ({bad_trunks} line 28) returned 1 feature tensor "
        "for the 2 layers asked for in out_feat_keys (fc, fc2, from config.MODEL.FEATURE_EVAL_SETTINGS."
        "LINEAR_EVAL_FEAT_POOL_OPS_MAP); a trunk returns one tensor per name in out_feat_keys, in that order"), err
    assert not list((tmp_path / "run").glob("*.npy"))


CLASS_NAME_LABELS = """
from PIL import Image
from ssl_engine.registry import DATA_SOURCES


@DATA_SOURCES.register("names_its_classes")
class NamesItsClasses:
    def __init__(self, cfg, path, split, source_index):
        pass

    def __len__(self):
        return 40

    def get(self, idx):
        return Image.new("RGB", (32, 32))

    def labels(self):
        return ["cat", "dog"] * 20
"""


def test_a_data_source_whose_labels_are_class_names_is_one_line(tmp_path, capsys):
    """labels() that gives strings (was: a ValueError traceback from a loader at the first batch)
    is one line naming the label source, the class's file and line and a value, exit 2."""
    module = tmp_path / "class_name_labels.py"
    module.write_text(CLASS_NAME_LABELS)
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]",
                                   "config.DATA.TRAIN.DATA_SOURCES=[names_its_classes]", "config.DATA.TRAIN.DATA_PATHS=[x]",
                                   "config.DATA.TRAIN.LABEL_SOURCES=[names_its_classes]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == (f"error: config.DATA.TRAIN.LABEL_SOURCES[0] (names_its_classes): labels() of NamesItsClasses ({module} "
                   "line 6) gives str values such as 'cat'; labels are one integer class index per sample (number your "
                   "class names 0, 1, ...)"), err


def test_a_data_source_whose_constructor_takes_other_arguments_is_one_line(tmp_path, capsys):
    """A source class without (cfg, path, split, source_index) (was: a TypeError traceback before
    launch, exit 1) is one line naming its key, its file and line, exit 2."""
    module = tmp_path / "two_argument_source.py"
    module.write_text("from ssl_engine.registry import DATA_SOURCES\n\n\n@DATA_SOURCES.register('takes_a_path')\n"
                      "class TakesAPath:\n    def __init__(self, path):\n        pass\n")
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]",
                                   "config.DATA.TRAIN.DATA_SOURCES=[takes_a_path]", "config.DATA.TRAIN.DATA_PATHS=[x]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == (f"error: config.DATA.TRAIN.DATA_SOURCES[0]: data source 'takes_a_path' ({module} line 4) cannot be "
                   "built as TakesAPath(cfg, path, split, source_index): too many positional arguments; a data "
                   "source's constructor takes those four"), err


PATH_SOURCE = """
from ssl_engine.registry import DATA_SOURCES


@DATA_SOURCES.register("gives_paths")
class GivesPaths:
    def __init__(self, cfg, path, split, source_index):
        pass

    def __len__(self):
        return 40

    def get(self, idx):
        return f"/data/img{idx}.png"
"""


@pytest.mark.parametrize("transforms", ["[]", "[{name:RandomResizedCrop,size:32},{name:ToTensor}]"])
def test_a_data_source_whose_get_returns_no_image_is_one_line_naming_it(tmp_path, capsys, transforms):
    """get() that returns a path string was reported as the first transform's error ("check its
    settings") or, with no transforms, as a TRANSFORMS list that does not end in ToTensor; the
    line names the data source, its file and line, and what get returned, exit 2."""
    module = tmp_path / f"path_source_{len(transforms)}.py"
    module.write_text(PATH_SOURCE.replace("gives_paths", f"gives_paths_{len(transforms)}"))
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]",
                                   f"config.DATA.TRAIN.DATA_SOURCES=[gives_paths_{len(transforms)}]",
                                   "config.DATA.TRAIN.DATA_PATHS=[x]", "config.DATA.TRAIN.LABEL_TYPE=zero",
                                   "config.DATA.TRAIN.LABEL_SOURCES=[]", f"config.DATA.TRAIN.TRANSFORMS={transforms}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: config.DATA.TRAIN.DATA_SOURCES[0]: data source 'gives_paths_{len(transforms)}' "
                          f"({module} line 5) returned a str from get("), err
    assert err.endswith("get returns the sample's image (a PIL image, or a tensor when no transform needs an image)"), err


@pytest.mark.parametrize("length, text", [
    ("0", "error: config.DATA.TRAIN.DATA_PATHS: the TRAIN data is empty (data source 'sized_{n}' ({m} line 4) has 0 "
          "samples)"),
    ("None", "error: config.DATA.TRAIN.DATA_SOURCES[0]: data source 'sized_{n}' ({m} line 4) has no length "
             "('NoneType' object cannot be interpreted as an integer); a data source's __len__ returns its number of "
             "samples"),
], ids=["zero", "none"])
def test_a_data_source_of_no_samples_or_no_length_is_one_line_naming_it(tmp_path, capsys, length, text):
    """__len__ of 0 named no source; __len__ returning None was a TypeError traceback, exit 1."""
    n = "zero" if length == "0" else "none"
    module = tmp_path / f"sized_source_{n}.py"
    module.write_text(f"from ssl_engine.registry import DATA_SOURCES\n\n\n@DATA_SOURCES.register('sized_{n}')\n"
                      f"class Sized:\n    def __init__(self, cfg, path, split, source_index):\n        pass\n\n"
                      f"    def __len__(self):\n        return {length}\n\n    def get(self, idx):\n        return None\n")
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]",
                                   f"config.DATA.TRAIN.DATA_SOURCES=[sized_{n}]", "config.DATA.TRAIN.DATA_PATHS=[x]",
                                   "config.DATA.TRAIN.LABEL_SOURCES=[]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == text.format(n=n, m=module), err


def test_a_train_step_that_is_not_step_of_task_is_one_line_before_launch(tmp_path, capsys):
    """A train step that takes more than the task (was: a TypeError traceback at the first step,
    exit 1) is one line naming it, its file and line, exit 2."""
    module = tmp_path / "two_argument_step.py"
    module.write_text("from ssl_engine.registry import TRAIN_STEPS\n\n\n@TRAIN_STEPS.register('step_with_a_scale')\n"
                      "def step_with_a_scale(task, scale):\n    pass\n")
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]",
                                   "config.TRAINER.TRAIN_STEP_NAME=step_with_a_scale"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == (f"error: train step 'step_with_a_scale' (config.TRAINER.TRAIN_STEP_NAME) ({module} line 4) cannot be "
                   "called as step_with_a_scale(task): missing a required argument: 'scale'; a train step takes the "
                   "task alone"), err
    assert not (tmp_path / "run").exists()


BAD_LOSSES_AND_METERS = """
from classy_vision.losses import ClassyLoss
from classy_vision.meters import ClassyMeter
from ssl_engine.registry import COLLATORS, LOSSES, METERS


@LOSSES.register("returns_a_float")
class ReturnsAFloat(ClassyLoss):
    @classmethod
    def from_config(cls, config):
        return cls()

    def forward(self, output, target):
        return 1.0


@LOSSES.register("returns_per_row_losses")
class ReturnsPerRowLosses(ReturnsAFloat):
    def forward(self, output, target):
        return output[0].sum(1)


@LOSSES.register("takes_a_margin")
class TakesAMargin(ReturnsAFloat):
    def __init__(self, margin=1.0):
        super().__init__()

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@METERS.register("counts_but_has_no_value")
class CountsButHasNoValue(ClassyMeter):
    @classmethod
    def from_config(cls, config):
        return cls()

    def update(self, model_output, target):
        pass

    def reset(self):
        pass


@COLLATORS.register("returns_the_samples")
def returns_the_samples(batch):
    return list(batch)
"""


@pytest.fixture(scope="module")
def bad_losses_and_meters(tmp_path_factory) -> Path:
    module = tmp_path_factory.mktemp("bad_losses") / "bad_losses_and_meters.py"
    module.write_text(BAD_LOSSES_AND_METERS)
    return module


@pytest.mark.parametrize("args, text", [
    (["config.LOSS.name=returns_a_float"],
     "error: loss 'returns_a_float' (config.LOSS.name) ({m} line 7) returned float from forward; a loss returns a "
     "tensor of one value"),
    (["config.LOSS.name=returns_per_row_losses"],
     "error: loss 'returns_per_row_losses' (config.LOSS.name) ({m} line 17) returned a tensor of shape [16] from "
     "forward; a loss returns a tensor of one value"),
    (["config.LOSS.name=takes_a_margin", "+config.LOSS.takes_a_margin.margn=2"],
     "error: loss 'takes_a_margin' (config.LOSS.takes_a_margin) ({m} line 23) cannot be built from its options "
     "{{'margn': 2}}: TakesAMargin.__init__() got an unexpected keyword argument 'margn'; accepted: margin"),
    (["config.METERS.names=[counts_but_has_no_value]"],
     "error: meter 'counts_but_has_no_value' (config.METERS.names) ({m} line 33) lacks value, name, "
     "get_classy_state, set_classy_state; a meter has update(model_output, target), reset()"),
    (["config.DATA.TRAIN.COLLATE_FUNCTION=returns_the_samples"],
     "error: collator 'returns_the_samples' (config.DATA.TRAIN.COLLATE_FUNCTION) ({m} line 46) returned list; a "
     "collator returns a dict with 'data'"),
], ids=["loss-returns-a-float", "loss-returns-per-row-losses", "loss-rejects-its-options", "meter-without-value",
        "collator-returns-a-list"])
def test_a_loss_meter_or_collator_of_your_own_that_breaks_its_contract_is_one_line(tmp_path, capsys, bad_losses_and_meters,
                                                                          args, text):
    """A loss that returns a float (was: AttributeError 'float' has no attribute 'detach') or a
    vector (a reshape RuntimeError in the metrics hook), a loss whose constructor rejects its
    config options, a meter without value (an AttributeError at the first phase's end), and a
    collator that returns a list (an AttributeError traceback before launch) are one line naming
    the part, its key, file and line, exit 2."""
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
                                   f"config.USER_MODULES=[{bad_losses_and_meters}]", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(text.format(m=bad_losses_and_meters)), err


def test_a_last_batch_of_one_sample_under_batchnorm_is_one_line_with_the_fix(tmp_path, capsys):
    """33 samples in batches of 16 leave a last batch of 1, which BatchNorm cannot train on:
    one line with the arithmetic and DROP_LAST, exit 2 (was a ValueError traceback). A head's
    BatchNorm1d makes it certain before launch (no epoch is spent first); a BatchNorm2d on a 1x1
    map (resnet18's res5 on 32x32 digits) is found at the step that fails."""
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", "config.DATA.TRAIN.DATA_LIMIT=33",
                            "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,16,10],use_bn:true}]]"])
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-3000:]
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    for text in ("config.DATA.TRAIN: 33 samples per rank in batches of 16 leave a last batch of 1",
                 "the model's BatchNorm1d layer 'heads.0", "config.DATA.TRAIN.DROP_LAST=true"):
        assert text in err, err
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("*")), "the run started"
    proc = run_tool(["config=quick/supervised_digits", f"config.CHECKPOINT.DIR={tmp_path / 'resnet'}",
                     "config.TEST_MODEL=false", "config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=33",
                     "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16"])
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    for text in ("config.DATA.TRAIN: 33 samples per rank in batches of 16 leave a last batch of 1",
                 "a BatchNorm layer of the model cannot train on one value per channel (iteration 3, batch 3 of "
                 "the phase)",
                 "config.DATA.TRAIN.DROP_LAST=true"):
        assert text in err, err
    # two views of each image (SimCLR): a one-sample batch is two rows, which BatchNorm1d trains on
    proc = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path / 'views'}",
                     "config.OPTIMIZER.num_epochs=1", "config.DATA.TRAIN.DATA_LIMIT=9", "config.DATA.TRAIN.DROP_LAST=false",
                     "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
                     "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[512,512,64],use_bn:true}]]"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'one'}", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=1",
                                   "config.DATA.TRAIN.DATA_LIMIT=4",
                                   "config.MODEL.HEAD.PARAMS=[[mlp,{dims:[16,16,10],use_bn:true}]]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=1 gives batches of one sample" in err and "DROP_LAST" not in err, err


def test_debug_shows_the_traceback(folders, tmp_path):
    proc = run_tool(BASE + [f"config.CHECKPOINT.DIR={tmp_path}", "config.OPTIMIZER.num_epoch=3", "--debug"])
    # the traceback comes on top of the one line; the exit code is the same as without --debug
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown config key config.OPTIMIZER.num_epoch ")


# ------------------------------------------------------------------------------------------------
# Property tests: whatever the user types or writes, compose either works or says why in a
# ConfigError (a UserError), never another exception.

_KEYS = ["config.LOG_FREQUENCY", "config.OPTIMIZER.num_epochs", "config.DATA.TRAIN.DATA_SOURCES", "config.MODEL",
         "config.MODEL.HEAD.PARAMS", "config.CHECKPOINT.DIR", "config.SEED_VALUE", "config.OPTIMIZER.weight_decay",
         "engine_name", "config", "+config.NEW", "++config.X.Y", "~config.VERBOSE", "config.DATA.TRAIN", "hydra.x"]
_VALUE_CHARS = string.ascii_letters + string.digits + " ,.:;[]{}()'\"=+-_~$/\\!@#%^&*?<>|\t"


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(
    st.text(alphabet=_VALUE_CHARS, max_size=30),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(_KEYS), st.text(alphabet=_VALUE_CHARS, max_size=20)),
), max_size=3))
def test_random_overrides_compose_or_raise_config_error(overrides):
    from ssl_engine.config import compose

    try:
        compose(["config=quick/supervised_digits"] + overrides, warn_unused=False)
    except ConfigError:
        pass


@pytest.mark.parametrize("override, key", [
    ("config=~nosuchuser0/x.yaml", "config"),
    ("config=~nosuchuser0", "config"),
    ('config.CHECKPOINT.DIR="~nosuchuser0/runs"', "config.CHECKPOINT.DIR"),
    ('config.DATA.TRAIN.DATA_PATHS=["~nosuchuser0/a"]', "config.DATA.TRAIN.DATA_PATHS[0]"),
    ('config.MODEL.WEIGHTS_INIT.PARAMS_FILE="~nosuchuser0"', "config.MODEL.WEIGHTS_INIT.PARAMS_FILE"),
])
def test_a_home_folder_of_an_unknown_user_is_a_config_error_naming_the_key(override, key):
    """``~name`` of a user the machine does not have: Path.expanduser raised a bare RuntimeError."""
    from ssl_engine.config import compose

    overrides = ([] if override.startswith("config=") else ["config=quick/supervised_digits"]) + [override]
    with pytest.raises(ConfigError) as e:
        compose(overrides, warn_unused=False)
    assert str(e.value).startswith(f"{key}=") and "'~nosuchuser0' names the home folder of user 'nosuchuser0'" in str(e.value)


def test_an_unknown_users_home_in_a_split_an_extraction_leaves_out_is_not_checked():
    from ssl_engine.config import compose

    cfg = compose(["config=quick/simclr_synthetic", "engine_name=extract_features", "config.EXTRACT_FEATURES.SPLITS=[TRAIN]",
                   'config.DATA.TEST.DATA_PATHS=["~nosuchuser0/x"]'], warn_unused=False)
    assert cfg.DATA.TEST.DATA_PATHS == ["~nosuchuser0/x"]
    with pytest.raises(ConfigError, match=r"config.DATA.TEST.DATA_PATHS\[0\]=~nosuchuser0/x"):
        compose(["config=quick/simclr_synthetic", "engine_name=extract_features", "config.EXTRACT_FEATURES.SPLITS=[TEST]",
                 'config.DATA.TEST.DATA_PATHS=["~nosuchuser0/x"]'], warn_unused=False)


def test_a_user_module_in_an_unknown_users_home_is_one_line(tmp_path):
    r = run_tool(["config=quick/simclr_synthetic", f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
                  'config.USER_MODULES=["~nosuchuser0/parts.py"]'])
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert "config.USER_MODULES=~nosuchuser0/parts.py" in err[0] and "write the path out in full" in err[0]


_yaml_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True),
                       st.text(max_size=12))
_yaml_key = st.one_of(st.sampled_from(["config", "engine_name", "defaults", "DATA", "TRAIN", "LOG_FREQUENCY",
                                       "OPTIMIZER", "num_epochs", "MODEL", "HEAD", "PARAMS", "hydra"]),
                      st.text(min_size=1, max_size=8), st.integers(-3, 3))
_yaml_tree = st.recursive(_yaml_leaf, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                             st.dictionaries(_yaml_key, kids, max_size=4)),
                          max_leaves=12)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    _yaml_tree.map(lambda t: "# @package _global_\n" + yaml.safe_dump(t)),
    st.dictionaries(st.just("config"), _yaml_tree, min_size=1).map(lambda t: "# @package _global_\n" + yaml.safe_dump(t)),
    st.text(max_size=60),
))
def test_random_yaml_documents_compose_or_raise_config_error(tmp_path_factory, document):
    from ssl_engine.config import compose
    from ssl_engine.config.validate import check_data_paths, check_registered_names
    from ssl_engine.engines.run import load_builtin_parts

    path = tmp_path_factory.mktemp("doc") / "experiment.yaml"
    path.write_bytes(document.encode("utf-8", errors="replace"))
    try:
        cfg = compose([f"config={path}"], warn_unused=False)
    except ConfigError:
        return
    load_builtin_parts()
    try:  # the cheap checks the tool runs next must cope with whatever composed
        check_registered_names(cfg)
        check_data_paths(cfg)
    except UserError:
        pass


def test_more_ranks_than_gpus_is_one_line_before_any_process_starts(tmp_path, capsys, monkeypatch):
    """NUM_PROC_PER_NODE above the GPUs present on a GPU run (one GPU pretended, no rank starts)."""
    import ssl_engine.launch as launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch, "RankGroup", None)  # starting ranks would fail loudly
    monkeypatch.setattr(launch, "_in_process", None)
    folder = tmp_path / "run"
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={folder}", "config.MACHINE.DEVICE=gpu",
                                   "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "config.DISTRIBUTED.NUM_PROC_PER_NODE=2" in err[0] and "1 GPU" in err[0], err[0]


def test_more_loader_workers_than_the_ranks_machine_can_start_is_one_line(tmp_path, capsys, monkeypatch):
    """Within the bound checked before launch (which may run on a login node), the rank itself
    refuses more workers than max(64, 8 x its CPUs) before starting any (2 CPUs pretended)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", "config.DATA.NUM_DATALOADER_WORKERS=100"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "config.DATA.NUM_DATALOADER_WORKERS=100" in err[0] and "(2 CPUs)" in err[0] and "at most 64" in err[0], err[0]


def test_a_url_as_an_output_folder_creates_nothing(tmp_path, capsys, monkeypatch):
    """CHECKPOINT.DIR (or another folder the run writes) given as a URL: one line naming the key and
    the URL, and no folder named after it ('s3:/bucket/...') appears where the command ran."""
    monkeypatch.chdir(tmp_path)
    for key in ("config.CHECKPOINT.DIR", "config.HOOKS.TENSORBOARD_SETUP.LOG_DIR"):
        capsys.readouterr()
        code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"{key}=s3://bucket/runs/x"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err == (f"error: {key}: s3://bucket/runs/x is a URL; ssl_engine writes only to local "
                                     f"folders: set {key} to a local folder"), err
        assert list(tmp_path.iterdir()) == []


def test_the_batch_of_one_line_counts_the_ranks_whole_share_in_a_resumed_phase():
    """A phase resumed at batch 2 of 3: the rank's share is still 33 samples (the sampler's length
    counts the 1 left, and the line said "1 samples per rank in batches of 16")."""
    from types import SimpleNamespace

    from ssl_engine.config import compose
    from ssl_engine.data import StatefulDistributedSampler
    from ssl_engine.train_steps.standard_train_step import explain_one_sample_batch

    sampler = StatefulDistributedSampler(33, num_replicas=1, rank=0, batch_size=16)
    sampler.set_start_iter(2)
    assert len(sampler) == 1
    task = SimpleNamespace(config=compose(BASE + ["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16"], warn_unused=False),
                           train=True, iteration=2, local_iteration_num=2,
                           dataloaders={"TRAIN": SimpleNamespace(sampler=sampler)})
    with pytest.raises(UserError, match=r"^config.DATA.TRAIN: 33 samples per rank in batches of 16 leave a last "
                                        r"batch of 1, and a BatchNorm layer"):
        explain_one_sample_batch(task, torch.zeros(1, 3), ValueError("Expected more than 1 value per channel"))


def test_the_batch_of_one_check_leaves_syncbn_across_ranks_alone():
    """SyncBatchNorm over several ranks normalises their batches together: a last batch of one
    sample per rank trains there, so the check before launch must not refuse it."""
    from types import SimpleNamespace

    from ssl_engine.config import compose
    from ssl_engine.config.validate import check_no_batch_of_one

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    loader = SimpleNamespace(sampler=range(17))  # 17 samples per rank in batches of 16: a last batch of 1
    base = BASE + ["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]
    with pytest.raises(UserError, match="17 samples per rank in batches of 16 leave a last batch of 1"):
        check_no_batch_of_one(compose(base, warn_unused=False), model, loader, 2)
    synced = compose(base + ["config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=true"], warn_unused=False)
    check_no_batch_of_one(synced, model, loader, 2)
    with pytest.raises(UserError):  # one rank: nothing to sync with
        check_no_batch_of_one(synced, model, loader, 1)


def test_the_best_metric_check_reads_the_phases_that_run():
    # TEST_ONLY runs test phases whatever TEST_MODEL says; no TEST data means no test phase
    from ssl_engine.config import compose
    from ssl_engine.hooks.best_checkpoint import check_metric_before_launch
    from ssl_engine.meters import build_meters

    cfg = compose(BASE + ["config.TEST_ONLY=true", "config.HOOKS.BEST_CHECKPOINT.METRIC=test_accuracy_list_meter/top_1"],
                  warn_unused=False)
    check_metric_before_launch(cfg, build_meters(cfg.METERS), ["TEST"])
    with pytest.raises(UserError, match="this run has no test phase"):
        check_metric_before_launch(cfg, build_meters(cfg.METERS), ["TRAIN"])


@pytest.mark.parametrize("key, value, extra", [
    ("config.MODEL.WEIGHTS_INIT.PARAMS_FILE", "specify the model weights", []),
    ("config.DATA.TRAIN.DATA_PATHS", "['<path to train folder>']",
     ["config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.LABEL_SOURCES=[disk_folder]"]),
])
def test_a_placeholder_a_vissl_config_leaves_is_named_as_one(tmp_path, key, value, extra, capsys):
    """VISSL's shipped configs leave values for the user to fill in: the line quotes the value
    and says that it is the file's placeholder."""
    capsys.readouterr()
    code = main_in_process(BASE + extra + [f"{key}={value}", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"'{value.strip('[]').strip(chr(39))}' does not exist (a placeholder of the config file: set {key} to your path)" in err, err


def test_user_modules_are_found_from_the_folder_the_tool_runs_in(tmp_path):
    """A dotted module or a relative file of USER_MODULES is looked for from the current folder (the
    tool's own folder is first on sys.path, not the one it runs in), in the ranks too."""
    (tmp_path / "sub").mkdir()
    for name, hook in (("my_parts.py", "DottedMarker"), ("sub/my_file_parts.py", "FileMarker")):
        (tmp_path / name).write_text(
            "import os\nfrom ssl_engine.hooks.base import SSLHook\nfrom ssl_engine.registry import HOOKS\n\n\n"
            f"@HOOKS.register({hook!r})\nclass Marker(SSLHook):\n    def on_end(self, task):\n"
            f"        open(os.path.join(task.checkpoint_folder, {hook!r}), 'w').close()\n")
    folder = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(TOOL), *BASE, f"config.CHECKPOINT.DIR={folder}", "config.OPTIMIZER.num_epochs=1",
         "config.USER_MODULES=[my_parts,sub/my_file_parts.py]", "config.HOOKS.CUSTOM=[{name:DottedMarker},{name:FileMarker}]",
         "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"],
        cwd=str(tmp_path), env=tool_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (folder / "DottedMarker").exists() and (folder / "FileMarker").exists()
    proc = subprocess.run([sys.executable, str(TOOL), *BASE, f"config.CHECKPOINT.DIR={tmp_path / 'other'}",
                           "config.USER_MODULES=[not_here]"], cwd=str(tmp_path), env=tool_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "config.USER_MODULES: cannot import not_here: No module named 'not_here'" in proc.stderr


@pytest.mark.parametrize("source, line, what", [
    ("from ssl_engine.registry import TRUNKS\ndef f(:\n    pass\n", 2, "SyntaxError: invalid syntax"),
    ("import os\nsettings = {}\nratio = 1 / len(settings)\n", 3, "ZeroDivisionError: division by zero"),
    ("import no_such_package_of_yours\n", 1, "ModuleNotFoundError: No module named 'no_such_package_of_yours'"),
    ("from torch import nn\nfrom ssl_engine.registry import TRUNKS\n\n\n@TRUNKS.register('mlp')\n"
     "class MyMLP(nn.Module):\n    pass\n", 5,
     "trunk 'mlp' is already registered to ssl_engine.models.trunks.mlp.MLPTrunk; register yours under another name"),
], ids=["syntax-error", "raises-at-import", "imports-a-missing-package", "name-of-a-built-in"])
def test_a_user_module_that_cannot_be_imported_is_one_line_naming_its_file_and_line(tmp_path, capsys, source, line, what):
    """A syntax error, an exception at the module's top level, or a part registered under a
    built-in's name is one line with the module's file and line, exit 2 (was a traceback, exit 1)."""
    module = tmp_path / f"parts_{tmp_path.name.replace('-', '_')}.py"
    module.write_text(source)
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", f"config.USER_MODULES=[{module}]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == f"error: config.USER_MODULES: cannot import {module} ({module} line {line}): {what}", err
    assert not (tmp_path / "run").exists()


def test_a_folder_in_place_of_the_checkpoint_pointer_is_refused_before_launch(tmp_path, capsys):
    """Found only at the first checkpoint, it cost the training up to there on every rerun."""
    (tmp_path / "run" / "checkpoint.torch").mkdir(parents=True)
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{tmp_path / 'run' / 'checkpoint.torch'} is a folder, not the run's checkpoint pointer" in err, err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint.torch"]


@pytest.mark.parametrize("name", ["model_phase0.torch", "model_iteration2.torch", "model_final_checkpoint_phase0.torch"])
def test_a_folder_in_place_of_a_checkpoint_is_refused_before_launch(tmp_path, capsys, name):
    """A folder named as a checkpoint the run writes: the run trained up to that checkpoint and
    stopped there ('cannot write model_phase0.torch in ...: Is a directory'), on every rerun."""
    (tmp_path / "run" / name).mkdir(parents=True)
    capsys.readouterr()
    code = main_in_process(BASE + [f"config.CHECKPOINT.DIR={tmp_path / 'run'}", "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == (f"error: config.CHECKPOINT.DIR {tmp_path / 'run'}: {tmp_path / 'run' / name} is a folder, not a "
                   f"checkpoint (a file the run writes at a checkpoint of that name); move or remove it"), err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [name]


@pytest.mark.parametrize("script, name, engine_option", [
    ("run_distributed_engines.py", "run_distributed_engines.py", True),
    ("nearest_neighbor_test.py", "nearest_neighbor_test.py", False),
])
def test_each_tool_prints_its_own_usage_and_options(script, name, engine_option):
    """--help names the tool that runs and the forms of override it takes; the kNN test, which runs
    the extract_features engine itself, does not offer --engine and refuses it."""
    path = str(Path(TOOL).parent / script)
    out = run_tool(["--help"], script=path, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: {name} config="), out.stdout
    for form in ("config.A.B=value", "+config.A.NEW=value", "~config.A.B", "+config/GROUP=NAME", "node_id=K", "--debug"):
        assert form in out.stdout, (form, out.stdout)
    assert ("--engine=" in out.stdout) == engine_option
    if not engine_option:
        refused = run_tool(["--engine=train", "config=extract/simclr_digits_trunk"], script=path, timeout=60)
        assert refused.returncode == 2 and refused.stderr.strip() == (
            "error: unknown option '--engine=train'; options are --debug, --help (see --help)"), refused.stderr


def test_help_into_a_closed_pipe_ends_quietly():
    """`--help | head -1`: the reader closes the pipe before the usage is written; that printed a
    BrokenPipeError traceback (and 'Exception ignored ... stdout') in about one run in four. The
    read end is closed before the tool writes, so every run meets the closed pipe."""
    proc = subprocess.Popen([sys.executable, TOOL, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=tool_env(), cwd=str(Path(TOOL).parent.parent))
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_the_demo_refuses_a_folder_it_cannot_make_before_it_starts(tmp_path):
    """demo.py --folder under a file started the training tool, which printed its line about
    config.CHECKPOINT.DIR, and the demo added its own and ended with exit code 1."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = run_tool(["--folder", str(blocker / "demo")], script=str(Path(TOOL).parent / "demo.py"), timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"error: --folder={blocker / 'demo'} cannot be created: {blocker} is a file", out.stderr
    assert out.stdout == ""  # nothing started


@pytest.mark.parametrize("tool", ["run_distributed_engines.py", "demo.py"])
def test_a_working_folder_deleted_under_the_shell_is_one_line(tmp_path, tool):
    """A shell left in a folder that was then deleted: importing torch there ended the tool with MKL's
    "FATAL ERROR: Cannot load libtorch_cpu.so" (exit 2, no word of the cause); the demo, given a
    relative --folder there, said "--folder=run cannot be reached: a loop of symbolic links"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    args = (f"config=quick/supervised_digits config.CHECKPOINT.DIR={tmp_path / 'run'}"
            if tool == "run_distributed_engines.py" else "--folder run")
    script = f"cd {gone} && rmdir {gone} && exec {sys.executable} {Path(TOOL).parent / tool} {args}"
    out = subprocess.run(["bash", "-c", script], env=tool_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("error: the current folder no longer exists (it was deleted after this shell entered "
                                  "it); cd to an existing folder and run the command again"), out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["run_distributed_engines.py", "nearest_neighbor_test.py"])
def test_a_tool_run_without_arguments_asks_for_an_experiment(script, tmp_path):
    """No arguments composed the defaults alone, and the line was "config.DATA.TRAIN.DATA_SOURCES is
    empty", about a key the user had not thought of, not about the config= they had left out."""
    out = subprocess.run([sys.executable, str(Path(TOOL).parent / script)], cwd=str(tmp_path), env=tool_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("error: no arguments: name an experiment with config=NAME or config=/path/to/file.yaml, "
                                  "e.g. config=quick/simclr_digits (--help lists the forms of override)"), out.stderr
    assert list(tmp_path.iterdir()) == []
