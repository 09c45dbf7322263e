"""Starting a run from a trained model (`init_from: PATH`): the model's shape, the checks, the record, and the
load of the weights.

PATH is a Hugging Face model directory (the released Huginn-0125 layout: sharded safetensors, their index and the
released config.json keys; a `python -m huginn_ray.model.export` output), a training checkpoint of this project
(its `model/` beside the DCP `state/`; only a complete one), or a training output directory (its newest complete
checkpoint, named on the console with every newer one it skipped). PATH may be a bucket URI (`s3://...`) naming a
model directory or a training checkpoint: the driver and every node read it from the node's local copy
(huginn_ray.model_cache, downloaded once per node). The model's shape
is the directory's config.json; the weights are loaded by every rank before step 1 (`load_weights_into`); the
optimizer, the schedule and the data start fresh. A run that resumes reads its own checkpoint instead.

Everything here but `load_weights_into` runs on the driver, at preflight, before Ray starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from huginn_ray import storage
from huginn_ray.config import ConfigError
from huginn_ray.data.tokenizer import TOKENIZER_FILE, load_tokenizer_file
from huginn_ray.model import ModelConfig, RecurrentGPT
from huginn_ray.model.pretrained import CONFIG_NAME, check_weights, open_weights, reading_checkpoint_model, \
    tensor_locations, training_state, weights_digest
from huginn_ray.model_cache import in_bucket, local_model_dir
from huginn_ray.train import replica_read
from huginn_ray.train.run_plan import WeightsSource

# ModelConfig fields that are training choices of this run, not the shape of the weights
RUN_FIELDS = ("name", "activation_checkpointing")


def model_config(cfg) -> ModelConfig:
    """The ModelConfig a TrainConfig trains: the `model` section (registry name + overrides), or with `init_from`
    the directory's config.json, which an explicit `model` section must agree with field by field."""
    if not cfg.init_from:
        return section_config(cfg)
    directory = local_model_dir(cfg.init_from, "init_from")
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


def check_tokenizer(init_from: str | Path, tokenizer_path: str, tokenizer_ids: dict) -> None:
    """data.tokenizer_path must be the model's: its special ids equal the bos/eos/pad ids of the config.json of
    the model directory `init_from` names (where it names them), and its vocabulary equals the directory's own
    tokenizer.json (where it has one). `tokenizer_ids`: huginn_ray.data.tokenizer.special_token_ids of
    tokenizer_path (a local path or a location)."""
    directory = local_model_dir(init_from, "init_from")
    config = json.loads((directory / CONFIG_NAME).read_text())
    for name in ("bos", "eos", "pad"):
        expected = config.get(f"{name}_token_id")
        if expected is not None and expected != tokenizer_ids[name]:
            raise ConfigError(f"data.tokenizer_path: its {name} id is {tokenizer_ids[name]}, the model in {init_from} "
                              f"was trained with {name}_token_id={expected} ({CONFIG_NAME}): another tokenizer")
    own = directory / TOKENIZER_FILE
    if own.is_file():
        theirs = load_tokenizer_file(own).get_vocab(with_added_tokens=True)
        mine = load_tokenizer_file(storage.join(str(tokenizer_path), TOKENIZER_FILE)).get_vocab(with_added_tokens=True)
        if theirs != mine:
            token, index = sorted(set(theirs.items()) ^ set(mine.items()), key=lambda item: item[1])[0]
            raise ConfigError(f"data.tokenizer_path: its vocabulary differs from the model's ({own}), e.g. at "
                              f"{token!r} -> {index}: another tokenizer")


def describe_source(init_from: str, model_cfg: ModelConfig) -> WeightsSource:
    """What the plan carries and MLflow records: the model directory (a bucket URI as it is: each worker reads its
    node's copy), and the sha256 of its weights (read tensor by tensor); the weights are checked first (every
    parameter there with its shape: the files' headers only)."""
    directory = local_model_dir(init_from, "init_from", log=lambda line: print(line, flush=True))
    try:
        check_weights(directory, model_cfg)
    except ValueError as err:
        raise ConfigError(f"init_from: {err}") from None
    hashed, sha256 = weights_digest(directory)
    return WeightsSource(init_from if in_bucket(init_from) else str(directory), hashed, sha256)


@torch.no_grad()
def load_weights_into(model: RecurrentGPT, directory: str | Path, replicas=None) -> None:
    """Fill `model`'s parameters (given storage by `RecurrentGPT.allocate`, possibly FSDP2-sharded) from the model
    directory `directory` (any layout huginn_ray.model.pretrained.load_pretrained reads; a bucket URI through this
    node's copy, huginn_ray.model_cache), each rank reading only what it holds.

    safetensors (one file or index + shards): every parameter's slice this rank holds (the whole tensor, or its
    DTensor shard's rows) is read from the memory-mapped file and copied in, cast to the parameter's dtype; one
    tensor slice is in host memory at a time. A training checkpoint: DCP reads the pieces of every tensor this
    rank holds (a collective: every rank calls it). A tied head is the embedding (stored heads are not read).
    `replicas`: the process group of the ranks holding the same part as this one (the mesh's "replicate"
    dimension): each reads 1/R of the rows of its part and one all-gather per parameter over the group completes
    them, so the files are read once, not once per replica (a collective then, in both layouts; a training
    checkpoint through huginn_ray.train.replica_read.read_dcp).
    Raises ValueError naming the file and key for a missing, unexpected or differently shaped tensor."""
    directory = local_model_dir(directory, "init_from") if in_bucket(directory) else Path(directory)
    params = dict(model.named_parameters())  # a tied head is listed once, as transformer.wte.weight
    if (state_dir := training_state(directory)) is not None:
        with reading_checkpoint_model(state_dir):
            if replicas is None:
                import torch.distributed.checkpoint as dcp

                dcp.load({"model": params}, storage_reader=replica_read.counting_reader(state_dir))
            else:
                replica_read.read_dcp(state_dir, {"model": params}, replicas)
        return
    location = tensor_locations(directory)
    missing = sorted(set(params) - set(location))
    unexpected = sorted(set(location) - set(params) - {"freqs_cis", "lm_head.weight"})
    if missing or unexpected:
        raise ValueError(f"{directory}: the weights do not match the model of its {CONFIG_NAME}"
                         + (f"; missing: {', '.join(missing[:5])}" if missing else "")
                         + (f"; unexpected: {', '.join(unexpected[:5])}" if unexpected else ""))
    for key, param in params.items():
        stored = location[key]
        if list(stored.shape) != list(param.shape):
            raise ValueError(f"{stored.file}: {key} has shape {stored.shape}, the model's is {list(param.shape)}")
    handles, error = {}, None
    parts = {key: replica_read.local_rows(param) for key, param in params.items()}
    shares = dict(zip(parts, replica_read.deal([target for target, _ in parts.values()], replicas.size())
                      if replicas is not None else [None] * len(parts)))
    try:
        for key, (target, rows) in parts.items():
            index = replica_read.portion(target, shares[key], replicas)
            if index is not None:
                file = location[key].file
                if file not in handles:  # opened (its header read) once, by a rank that reads from it
                    handles[file] = open_weights(file)
                values = handles[file].get_slice(key)[replica_read.in_whole(index, rows.start if rows else 0)]
                replica_read.count_read(values.numel() * values.element_size())
                target[index].copy_(values)
    except (SafetensorError, OSError) as err:
        error = f"{directory}: a weights file cannot be read: {err}"
    finally:
        handles.clear()
    if replicas is not None:
        # the replicas complete each other only when every one of them has read its rows
        failed = torch.tensor([float(error is not None)], device=next(iter(params.values())).device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=replicas)
        if failed.item() and error is None:
            error = f"{directory}: a replica of this rank's part (ranks {dist.get_process_group_ranks(replicas)}) " \
                    "could not read its rows"
    if error is not None:
        raise ValueError(error)
    if replicas is not None:
        for key, (target, _) in parts.items():
            replica_read.complete_over_replicas(target, shares[key], replicas)
