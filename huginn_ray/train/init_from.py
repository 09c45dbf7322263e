"""Starting a run from a trained model (`init_from: PATH`): the model's shape, the checks, the record.

PATH is a Hugging Face model directory (the released Huginn-0125 layout: sharded safetensors, their index and the
released config.json keys; a `python -m huginn_ray.model.export` output), a training checkpoint of this project
(its `model/` beside the DCP `state/`; only a complete one), or a training output directory (its newest complete
checkpoint, named on the console with every newer one it skipped). The model's shape
is the directory's config.json; the weights are loaded by every rank before step 1
(huginn_ray.model.pretrained.load_weights_into); the optimizer, the schedule and the data start fresh. A run that
resumes reads its own checkpoint instead.

Everything here runs on the driver, at preflight, before Ray starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from huginn_ray.config import ConfigError
from huginn_ray.data.tokenizer import TOKENIZER_FILE
from huginn_ray.model import ModelConfig
from huginn_ray.model.pretrained import CONFIG_NAME, check_weights, resolve_model_dir, weights_digest
from huginn_ray.train.run_plan import WeightsSource

# ModelConfig fields that are training choices of this run, not the shape of the weights
RUN_FIELDS = ("name", "activation_checkpointing")


def model_config(cfg) -> ModelConfig:
    """The ModelConfig a TrainConfig trains: the `model` section (registry name + overrides), or with `init_from`
    the directory's config.json, which an explicit `model` section must agree with field by field."""
    if not cfg.init_from:
        return section_config(cfg)
    directory = resolve_model_dir(cfg.init_from, "init_from")
    try:
        stored = ModelConfig.from_json(directory / CONFIG_NAME)
    except ValueError as err:
        raise ConfigError(f"init_from: {err}") from None
    if cfg.model is not None:
        check_agrees(cfg.model, stored, directory)
    return stored.replace(activation_checkpointing=cfg.activation_checkpointing)


def section_config(cfg) -> ModelConfig:
    """The ModelConfig of the `model` section alone (raven-tiny when there is none). With init_from the memory
    plan uses it when the section is given, so that a recipe's plan needs no weights on this machine (preflight
    checks that it agrees with the directory)."""
    from huginn_ray.train.config import ModelSection

    section = cfg.model or ModelSection()
    return ModelConfig.from_name(section.name, **{"activation_checkpointing": cfg.activation_checkpointing,
                                                  **section.overrides.given()})


def check_agrees(section, stored: ModelConfig, directory: Path) -> None:
    """Refuse an explicit `model` section that describes another shape than the directory's, naming the field."""
    try:
        explicit = ModelConfig.from_name(section.name, **section.overrides.given())
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model: {err}") from None
    for field in dataclasses.fields(ModelConfig):
        if field.name in RUN_FIELDS:
            continue
        mine, theirs = getattr(explicit, field.name), getattr(stored, field.name)
        if mine != theirs:
            given = (f"model.overrides.{field.name}={mine!r}" if field.name in section.overrides.given()
                     else f"model.name={section.name} gives {field.name}={mine!r}")
            raise ConfigError(f"{given}, but init_from {directory / CONFIG_NAME} has {field.name}={theirs!r}: the "
                              "shape comes from init_from (leave the model section out, or make it agree)")


def check_tokenizer(directory: Path, tokenizer_path: str, tokenizer_ids: dict) -> None:
    """data.tokenizer_path must be the model's: its special ids equal the bos/eos/pad ids of the directory's
    config.json (where it names them), and its vocabulary equals the directory's own tokenizer.json (where it has
    one). `tokenizer_ids`: huginn_ray.data.tokenizer.special_token_ids of tokenizer_path."""
    from tokenizers import Tokenizer

    config = json.loads((directory / CONFIG_NAME).read_text())
    for name in ("bos", "eos", "pad"):
        expected = config.get(f"{name}_token_id")
        if expected is not None and expected != tokenizer_ids[name]:
            raise ConfigError(f"data.tokenizer_path: its {name} id is {tokenizer_ids[name]}, the model in {directory} "
                              f"was trained with {name}_token_id={expected} ({CONFIG_NAME}): another tokenizer")
    own = directory / TOKENIZER_FILE
    if own.is_file():
        theirs = Tokenizer.from_file(str(own)).get_vocab(with_added_tokens=True)
        mine = Tokenizer.from_file(str(Path(tokenizer_path) / TOKENIZER_FILE)).get_vocab(with_added_tokens=True)
        if theirs != mine:
            token, index = sorted(set(theirs.items()) ^ set(mine.items()), key=lambda item: item[1])[0]
            raise ConfigError(f"data.tokenizer_path: its vocabulary differs from the model's ({own}), e.g. at "
                              f"{token!r} -> {index}: another tokenizer")


def describe_source(init_from: str, model_cfg: ModelConfig) -> WeightsSource:
    """What the plan carries and MLflow records: the model directory, and the sha256 of its weights (read tensor by
    tensor); the weights are checked first (every parameter there with its shape: the files' headers only)."""
    directory = resolve_model_dir(init_from, "init_from", log=lambda line: print(line, flush=True))
    try:
        check_weights(directory, model_cfg)
    except ValueError as err:
        raise ConfigError(f"init_from: {err}") from None
    hashed, sha256 = weights_digest(directory)
    return WeightsSource(str(directory), hashed, sha256)
