"""init_from: a run starts from a trained model (huginn_ray.train.init_from: the checks, and load_weights_into).

A directory in the released Huginn-0125 layout (bf16 safetensors in three shards, their index, the released
config.json keys) is trained on for one step at lr 0 by 4 gloo ranks, as replicate and as hsdp 2 x 2, through the
training loop's own build_components and train_step; each run's checkpoint, exported, gives the directory's
logits back at depths 1 and 4. The hsdp run starts from the replicate run's training checkpoint (the DCP route);
its ranks hold half the parameters each. The driver-side checks refuse a disagreeing model section, another
tokenizer and missing weights by name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from huginn_ray.config import ConfigError, load_config
from huginn_ray.model import ModelConfig, RecurrentGPT, load_pretrained
from huginn_ray.model.pretrained import resolve_model_dir
from huginn_ray.train import init_from
from huginn_ray.train.config import TrainConfig

VOCAB = 64  # test_train_parallel's in-memory reader emits ids below 64


def released_config(cfg: ModelConfig) -> dict:
    """The released huginn-0125 config.json's keys, with the values of `cfg`."""
    return {
        "architectures": ["RavenForCausalLM"], "architecture_class_name": "RecurrentGPT",
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
        "model_type": "huginn_raven", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
        "activation_checkpoint_impl": "per-iteration", "bias": False, "block_class_name": "SandwichBlock",
        "block_size": cfg.block_size, "effective_expected_depth": cfg.effective_expected_depth,
        "head_dim": cfg.head_dim, "init_orthogonal": False, "init_strategy": "takase", "injection_type": "linear",
        "intermediate_size": cfg.intermediate_size, "mean_backprop_depth": cfg.mean_backprop_depth,
        "mean_recurrence": cfg.mean_recurrence, "mlp_class_name": "GatedMLP", "n_embd": cfg.n_embd,
        "n_heads": cfg.num_attention_heads,
        "n_layers": cfg.n_layers_in_prelude + cfg.n_layers_in_recurrent_block + cfg.n_layers_in_coda,
        "n_layers_in_coda": cfg.n_layers_in_coda, "n_layers_in_prelude": cfg.n_layers_in_prelude,
        "n_layers_in_recurrent_block": cfg.n_layers_in_recurrent_block, "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama", "norm_eps": cfg.norm_eps, "num_key_value_heads": cfg.num_attention_heads,
        "padded_vocab_size": cfg.padded_vocab_size, "padding_multiple": cfg.padding_multiple, "qk_bias": True,
        "rope_base": 50000, "sampling_scheme": "poisson-lognormal-filling", "state_init": "like-init",
        "test_time_noise": 0, "test_time_noise_type": "fixed", "tie_embeddings": True, "vocab_size": cfg.vocab_size,
        "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509,
    }


def write_released_layout(model: RecurrentGPT, directory: Path, shards: int = 3) -> Path:
    """`model` as the release stores huginn-0125: bf16 tensors (both tied keys) in `shards` files named
    model-0000i-of-0000n.safetensors, model.safetensors.index.json, config.json with the released keys."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(released_config(model.config), indent=2))
    tensors = {k: v.to(torch.bfloat16).clone() for k, v in model.state_dict().items() if k != "freqs_cis"}
    keys = sorted(tensors)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {key: names[i * shards // len(keys)] for i, key in enumerate(keys)}
    for name in names:
        save_file({k: tensors[k] for k in keys if weight_map[k] == name}, directory / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return directory


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The weights digest by its definition: every tensor's name, dtype, shape and bytes, in name order."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}\n".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def released_tensors(model: RecurrentGPT) -> dict[str, torch.Tensor]:
    """What write_released_layout stores of `model`, the tied head and the RoPE table left out."""
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k not in ("freqs_cis", "lm_head.weight")}


def tiny_model() -> RecurrentGPT:
    torch.manual_seed(11)
    return RecurrentGPT(ModelConfig.from_name("raven-tiny", vocab_size=VOCAB))


def config(*extra) -> TrainConfig:
    return load_config(TrainConfig, None, ["max_steps=1", "block_size=16", "data.data_dir=/nonexistent", *extra])


# ---- the driver's checks -----------------------------------------------------------------------------------
def test_the_shape_comes_from_the_directory_and_a_disagreeing_model_section_is_refused_by_name(tmp_path):
    released = write_released_layout(tiny_model(), tmp_path / "huginn")
    shape = init_from.model_config(config(f"init_from={released}"))
    assert shape == ModelConfig.from_name("raven-tiny", vocab_size=VOCAB).replace(
        name="custom", activation_checkpointing=True)
    # a model section that agrees is accepted; one that does not is refused naming the field
    agreeing = config(f"init_from={released}", "model.name=raven-tiny", f"model.overrides.vocab_size={VOCAB}")
    assert init_from.model_config(agreeing) == shape
    with pytest.raises(ConfigError, match=r"model.overrides.mean_recurrence=8, but init_from .*config.json has "
                                          r"mean_recurrence=4"):
        init_from.model_config(config(f"init_from={released}", f"model.overrides.vocab_size={VOCAB}",
                                      "model.overrides.mean_recurrence=8"))
    with pytest.raises(ConfigError, match=r"model.name=raven-small gives block_size=1024, but init_from .* has "
                                          r"block_size=256"):
        init_from.model_config(config(f"init_from={released}", "model.name=raven-small"))
    with pytest.raises(ConfigError, match=r"init_from: no model \(config.json"):
        init_from.model_config(config(f"init_from={tmp_path / 'nowhere'}"))


def test_missing_or_misshapen_weights_and_another_tokenizer_are_refused_before_ray(tmp_path):
    from huginn_ray.data.tokenizer import special_token_ids, train_tokenizer

    released = write_released_layout(tiny_model(), tmp_path / "huginn")
    shape = init_from.model_config(config(f"init_from={released}"))
    source = init_from.describe_source(str(released), shape)
    assert source.hashed == (f"{len(released_tensors(tiny_model()))} tensors of {released} (model-00001-of-00003"
                             ".safetensors, model-00002-of-00003.safetensors, model-00003-of-00003.safetensors)")
    assert source.sha256 == tensors_sha256(released_tensors(tiny_model()))
    with pytest.raises(ConfigError, match=r"transformer.wte.weight has shape \[64, 64\], the model of its "
                                          r"config.json has \[64, 32\]"):
        init_from.describe_source(str(released), shape.replace(n_embd=32, num_attention_heads=2))
    index = json.loads((released / "model.safetensors.index.json").read_text())
    del index["weight_map"]["transformer.ln_f.weight"]
    for name in set(index["weight_map"].values()):  # rewrite the shards without that tensor
        from safetensors.torch import load_file
        kept = {k: v for k, v in load_file(released / name).items() if k != "transformer.ln_f.weight"}
        save_file(kept, released / name)
    (released / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"no transformer.ln_f.weight"):
        init_from.describe_source(str(released), shape)

    tokenizer = tmp_path / "tokenizer"
    train_tokenizer(["one two three four five six"] * 20, 300, tokenizer, use_manual_tokens=False)
    ids = special_token_ids(tokenizer)
    with pytest.raises(ConfigError, match=rf"data.tokenizer_path: its bos id is {ids['bos']}, the model .* was "
                                          r"trained with bos_token_id=65504"):
        init_from.check_tokenizer(released, str(tokenizer), ids)
    # the directory's own tokenizer decides the vocabulary
    config_json = json.loads((released / "config.json").read_text())
    config_json.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    (released / "config.json").write_text(json.dumps(config_json))
    init_from.check_tokenizer(released, str(tokenizer), ids)
    other = tmp_path / "other"
    train_tokenizer(["seven eight nine ten eleven"] * 20, 300, other, use_manual_tokens=False)
    (released / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match=r"its vocabulary differs from the model's"):
        init_from.check_tokenizer(released, str(tokenizer), ids)


# ---- 4 gloo ranks: replicate, then hsdp 2 x 2 ---------------------------------------------------------------
def one_step_runs(rank, world_size, directory: Path):
    """Replicate and hsdp 2 x 2 from the released layout, hsdp 2 x 2 from the replicate run's training checkpoint:
    one step at lr 0 each, then a checkpoint. Reports the loss and the bytes of parameters a rank holds."""
    from test_train_parallel import MemoryReader, plan_for

    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train import loop
    from huginn_ray.train.init_from import describe_source
    from huginn_ray.train.parallel import local

    loop.ShardReader = MemoryReader
    cpu = torch.device("cpu")
    report = {}
    hsdp = ["parallelism.mode=hsdp"]  # nodes of 2 ranks: the local world size given to build_components
    for name, source, layout in (("replicate", "huginn", []), ("hsdp", "huginn", hsdp),
                                 ("hsdp from a checkpoint", "replicate_checkpoint", hsdp)):
        cfg = config(f"init_from={directory / source}", "optim.name=AdamW", "optim.lr=0", "skip_first_optimizer_step=false",
                     "micro_batch_size=2", "grad_sync.chunk_mib=0.05", f"scaling.num_workers={world_size}", *layout)
        model_cfg = init_from.model_config(cfg)
        plan = dataclasses.replace(plan_for(cfg), model_config=model_cfg,
                                   init_from=describe_source(cfg.init_from, model_cfg))
        c = loop.build_components(cfg, plan, rank, cpu, local_world_size=2)
        result = loop.train_step(c, 1, cfg, plan, cpu)
        out = directory / f"{name}_checkpoint".replace(" ", "_")
        ckpt.write(out, rank, c.model, c.optimizer, ckpt.TrainerState(step=1, world_size=world_size), cpu)
        report[name] = {"loss": result.loss, "grad_norm": result.grad_norm,
                        "param_bytes": sum(local(p).numel() * 4 for p in c.model.parameters()),
                        "tied": c.model.lm_head.weight is c.model.transformer.wte.weight,
                        "optimized": sum(len(group["params"]) for group in c.optimizer.param_groups),
                        "parameters": len(list(c.model.parameters()))}
        if hasattr(c.sync, "remove_hooks"):
            c.sync.remove_hooks()
    return report


def _run(rank, world_size, port, directory):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        result = one_step_runs(rank, world_size, Path(directory))
    except Exception as err:
        result = {"error": type(err).__name__, "trace": traceback.format_exc()}
    (Path(directory) / f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def test_one_step_at_lr_0_from_the_released_layout_exports_the_directory_s_logits_on_replicate_and_hsdp(tmp_path):
    from huginn_ray.model import export

    model = tiny_model()
    released = write_released_layout(model, tmp_path / "huginn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(4, port, str(tmp_path)), nprocs=4, start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}: {report.get('trace')}"
    # both layouts took the same step from the same weights
    for name in ("hsdp", "hsdp from a checkpoint"):
        assert reports[0][name]["loss"] == pytest.approx(reports[0]["replicate"]["loss"], rel=1e-6)
    assert reports[0]["replicate"]["grad_norm"] > 0
    for name in ("replicate", "hsdp", "hsdp from a checkpoint"):  # the head is the embedding, as in training
        assert reports[0][name]["tied"], name
        assert reports[0][name]["optimized"] == reports[0][name]["parameters"] == len(list(model.parameters()))
    whole = reports[0]["replicate"]["param_bytes"]
    for report in reports:  # under hsdp a rank allocated and read its half only
        assert abs(report["hsdp"]["param_bytes"] - whole / 2) <= 0.1 * whole / 2

    expected = load_pretrained(released).eval()
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    states = torch.randn(2, 12, expected.config.n_embd, generator=generator)
    for name in ("replicate", "hsdp", "hsdp from a checkpoint"):
        out = tmp_path / f"{name}_export".replace(" ", "_")
        checkpoint = tmp_path / f"{name}_checkpoint".replace(" ", "_")
        assert export.main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
        exported = load_pretrained(out).eval()
        with torch.no_grad():
            for depth in (1, 4):
                want = expected(ids, num_steps=(depth, 0), input_states=states).logits
                got = exported(ids, num_steps=(depth, 0), input_states=states).logits
                error = float((got - want).norm() / want.norm())
                assert error < 1e-6, (name, depth, error)


def test_preflight_records_the_source_and_refuses_the_released_ids_with_another_tokenizer(tmp_path):
    from test_train_data import make_dataset
    from test_train_preflight import tiny

    from huginn_ray.data.tokenizer import special_token_ids
    from huginn_ray.train.launch import PreflightError, preflight

    dataset = make_dataset(tmp_path / "data", num_shards=2, rows_per_shard=40, seq_len=32)
    released = write_released_layout(tiny_model(), tmp_path / "huginn")
    with pytest.raises(PreflightError, match=r"data.tokenizer_path: its bos id is \d+, the model in .*huginn was "
                                             r"trained with bos_token_id=65504"):
        preflight(tiny(dataset, tmp_path, f"init_from={released}"))
    ids = special_token_ids(dataset[1])
    config_json = json.loads((released / "config.json").read_text())
    config_json.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    (released / "config.json").write_text(json.dumps(config_json))
    plan = preflight(tiny(dataset, tmp_path, f"init_from={released}"))
    assert plan.init_from.path == str(released)
    assert plan.init_from.sha256 == tensors_sha256(released_tensors(tiny_model()))
    assert plan.model_config.mean_recurrence == 4
    job = importlib.util.module_from_spec(importlib.util.spec_from_file_location("train_job", JOBS / "train.py"))
    job.__spec__.loader.exec_module(job)
    assert job.startup_line(tiny(dataset, tmp_path, f"init_from={released}"), plan) == (
        f"[huginn] training tiny_cpu: 20 steps of 4 rows, 2 workers, model custom from {released}, fp32")


# ---- the recipes -------------------------------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[1] / "configs" / "train"
JOBS = Path(__file__).resolve().parents[1] / "jobs"


@pytest.mark.parametrize("name", ["finetune_huginn_chat", "continue_huginn"])
def test_the_recipes_load_agree_with_the_released_config_and_plan_within_80_gib(name, tmp_path, capsys):
    from huginn_ray.train import memory
    from huginn_ray.train.config import load_train_config

    path = RECIPES / f"{name}.yaml"
    cfg = load_train_config(str(path))
    assert cfg.parallelism.mode == "hsdp" and cfg.scaling.num_workers == 8 and cfg.precision == "bf16-mixed"
    if name == "finetune_huginn_chat":  # the original example's optimizer and schedule
        assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.eps) == ("AdamW", 5e-7, 0.0, 1e-8)
        assert cfg.schedule.min_lr == pytest.approx(1e-3 * cfg.optim.lr)
    # its model section is the released huginn-0125's config.json (the preflight would refuse it otherwise)
    released = tmp_path / "huginn-0125"
    released.mkdir()
    (released / "config.json").write_text(json.dumps(released_config(ModelConfig.from_name("nebel-raven-3.5b"))))
    assert init_from.model_config(load_train_config(str(path), [f"init_from={released}"])).n_embd == 5280
    assert memory.main(["--config", str(path)]) == 0
    total = re.search(r"total per rank: ([0-9.]+) GiB of 80.0 GiB", capsys.readouterr().out)
    assert total and float(total.group(1)) < 72.0, total


def test_mlflow_records_where_the_weights_came_from(tmp_path):
    from mlflow.tracking import MlflowClient

    from huginn_ray.train import tracking

    released = write_released_layout(tiny_model(), tmp_path / "huginn")
    cfg = config(f"init_from={released}", f"out_dir={tmp_path}")
    source = init_from.describe_source(cfg.init_from, init_from.model_config(cfg))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.open_run(cfg, uri, str(cfg.run_dir), source)
    params = MlflowClient(uri).get_run(run_id).data.params
    assert params["init_from.path"] == str(released)
    assert params["init_from.hashed"] == source.hashed
    assert params["init_from.sha256"] == tensors_sha256(released_tensors(tiny_model()))


def test_the_weights_digest_covers_the_tensors_bytes_in_either_layout(tmp_path):
    """One changed element of one shard changes the digest (the index, which the digest once hashed, stays as it
    was); a training checkpoint of a model and an export of the same weights give the same digest."""
    from huginn_ray.model.pretrained import save_pretrained, weights_digest
    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train.config import OptimConfig
    from huginn_ray.train.optim import build_optimizer

    model = tiny_model()
    released = write_released_layout(model, tmp_path / "huginn")
    before = weights_digest(released)[1]
    assert before == tensors_sha256(released_tensors(model))
    index = (released / "model.safetensors.index.json").read_bytes()
    from safetensors.torch import load_file
    shard = released / "model-00001-of-00003.safetensors"
    tensors = load_file(shard)
    name = min(set(tensors) - {"lm_head.weight"})  # the tied head is the embedding: not a weight of its own
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, shard, metadata={"format": "pt"})
    assert (released / "model.safetensors.index.json").read_bytes() == index
    assert weights_digest(released)[1] != before

    ckpt.write(tmp_path / "run" / "checkpoint_000001", 0, model, build_optimizer(model, OptimConfig()),
               ckpt.TrainerState(step=1, world_size=1), torch.device("cpu"))
    hashed, digest = weights_digest(tmp_path / "run" / "checkpoint_000001" / "model")
    assert hashed == f"{len(released_tensors(model))} tensors of {tmp_path / 'run' / 'checkpoint_000001' / 'state'}"
    fp32 = {k: v for k, v in model.state_dict().items() if k not in ("freqs_cis", "lm_head.weight")}
    assert digest == tensors_sha256(fp32) == weights_digest(save_pretrained(model, tmp_path / "export"))[1]


def test_init_from_takes_the_newest_complete_checkpoint_and_names_a_newer_incomplete_one(tmp_path, capsys):
    """An output directory with a complete checkpoint of step 1 and a newer one of step 2 without its completeness
    marker (a save that did not finish): init_from takes step 1 and says so, naming step 2 and why; named directly,
    step 2 is refused. The jobs that read a --checkpoint resolve it the same way."""
    import os
    import shutil

    from huginn_ray.train import checkpoint as ckpt
    from huginn_ray.train.config import OptimConfig
    from huginn_ray.train.optim import build_optimizer

    model = tiny_model()
    complete, unfinished = tmp_path / "out" / "run" / "checkpoint_000001", tmp_path / "out" / "run" / "checkpoint_000002"
    ckpt.write(complete, 0, model, build_optimizer(model, OptimConfig()), ckpt.TrainerState(step=1, world_size=1),
               torch.device("cpu"))
    shutil.copytree(complete, unfinished)
    (unfinished / ckpt.MARKER).unlink()
    stamp = (complete / "model" / "config.json").stat().st_mtime
    os.utime(unfinished / "model" / "config.json", (stamp + 10, stamp + 10))  # the newer one
    shape = init_from.model_config(config(f"init_from={tmp_path / 'out'}"))
    capsys.readouterr()
    source = init_from.describe_source(str(tmp_path / "out"), shape)
    assert source.path == str(complete / "model")
    assert capsys.readouterr().out.splitlines() == [
        f"[huginn] init_from: {complete}, the newest complete checkpoint under {tmp_path / 'out'}; skipped "
        f"{unfinished} (no checkpoint_complete.json: the save did not finish)"]
    for named in (unfinished, unfinished / "model"):
        with pytest.raises(ConfigError, match=rf"init_from: {re.escape(str(unfinished))} is not a complete "
                                              r"checkpoint: no checkpoint_complete.json: the save did not finish"):
            init_from.describe_source(str(named), shape)
    # the serving, generation, evaluation and export jobs resolve --checkpoint by the same rule
    assert resolve_model_dir(tmp_path / "out") == complete / "model"
    with pytest.raises(ConfigError, match=rf"--checkpoint: {re.escape(str(unfinished))} is not a complete "):
        resolve_model_dir(unfinished)
