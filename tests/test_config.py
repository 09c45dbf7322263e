"""YAML configs with dotted overrides: every unknown key and wrong type is refused by its dotted name."""

import re
from dataclasses import dataclass, field

import pytest

from huginn_ray.config import ConfigError, flatten, load_config, to_dict


@dataclass
class Optim:
    lr: float = 1e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""


@dataclass
class Run:
    name: str = "run"
    """Run name."""
    steps: int = 10
    """Steps."""
    resume: bool = True
    """Resume."""
    depths: list[int] = field(default_factory=lambda: [1, 4])
    """Validation depths."""
    optim: Optim = field(default_factory=Optim)
    """Optimizer settings."""
    note: str | None = None
    """Optional note."""


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: a\nsteps: 5\noptim:\n  lr: 4e-5\n  betas: [0.8, 0.9]\n")
    run = load_config(Run, path, ["steps=7", "optim.lr=1e-2", "depths=[1, 2, 3]", "note=hello"])
    assert run == Run(name="a", steps=7, depths=[1, 2, 3], optim=Optim(lr=1e-2, betas=(0.8, 0.9)), note="hello")
    assert isinstance(load_config(Run, path).optim.lr, float)  # plain PyYAML would read 4e-5 as a string
    assert flatten(to_dict(run))["optim.lr"] == 1e-2


@pytest.mark.parametrize("overrides, message", [
    (["optim.lrr=1"], "unknown config key 'optim.lrr'"),
    (["stepz=1"], "unknown config key 'stepz'"),
    (["steps=ten"], "steps: expected an integer"),
    (["steps=1.5"], "steps: expected an integer"),
    (["resume=1"], "resume: expected true/false"),
    (["optim.betas=[0.9]"], r"optim.betas"),
    (["depths=[1, x]"], r"depths\[1\]: expected an integer"),
    (["optim=3"], "optim: expected a mapping"),
    (["steps"], "not of the form key=value"),
])
def test_bad_keys_and_types_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Run, None, overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(Run, tmp_path / "nope.yaml")


@pytest.mark.parametrize("override, message", [
    ("optim.sharding=node", "optim.sharding was removed: set parallelism.mode=hsdp"),
    ("grad_sync.node_size=8", "grad_sync.node_size was removed: set parallelism.mode=hsdp"),
    ("grad_sync.kind=hierarchical", "grad_sync.kind=hierarchical was removed: set parallelism.mode=hsdp"),
    ("parallelism.shard_size=2", "parallelism.shard_size was removed: a shard group of parallelism.mode=hsdp is "
                                 "one Ray node"),
    ("parallelism.mode=hsdp grad_sync.kind=ddp", "under parallelism.mode=hsdp the exchange between shard groups is "
                                                 "chunk_stream"),
    ("parallelism.param_dtype=bfloat16", "parallelism.param_dtype=bfloat16: only parallelism.mode=hsdp gathers weights"),
    ("parallelism.mode=hsdp parallelism.param_dtype=bfloat16", "parallelism.param_dtype=bfloat16 needs "
                                                               "precision=bf16-mixed (precision=auto, on CPU trains in fp32)"),
])
def test_removed_sharding_keys_and_bad_layouts_are_refused_pointing_at_parallelism(override, message):
    from huginn_ray.train.config import load_train_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config(None, ["max_steps=1", *override.split()])


def test_model_overrides_are_the_model_config_s_fields_typed_and_refused_by_dotted_name():
    import dataclasses

    from huginn_ray.model import ModelConfig
    from huginn_ray.train.config import ModelOverrides, load_train_config
    from huginn_ray.train.init_from import RUN_FIELDS

    assert [f.name for f in dataclasses.fields(ModelOverrides)] == \
        [f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUN_FIELDS]
    cfg = load_train_config(None, ["max_steps=1", "model.overrides.vocab_size=64", "model.overrides.rope_base=1e4",
                                   "model.overrides.state_init=zero"])
    assert cfg.model.overrides.given() == {"vocab_size": 64, "state_init": "zero", "rope_base": 10000.0}
    for override, message in [
            ("model.overrides.n_emb=8", "unknown config key 'model.overrides.n_emb'"),
            ("model.overrides.vocab_size=big", "model.overrides.vocab_size: expected an integer, got 'big'"),
            ("model.overrides.state_init=noise", "model.overrides.state_init: 'noise' is not one of"),
            ("model.overrides.n_layers_in_coda=-1", "model.overrides.n_layers_in_coda: must be in [0, inf)"),
            ("model.overrides.activation_checkpointing=true",
             "unknown config key 'model.overrides.activation_checkpointing'"),
            ("model.overrides={vocab_size: 64, n_heads: 4}", "unknown config key 'model.overrides.n_heads'")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_train_config(None, ["max_steps=1", override])


def test_compile_options_are_typed_and_an_unknown_one_is_refused_by_dotted_name():
    from huginn_ray.train.config import compile_options_for, load_train_config

    cfg = load_train_config(None, ["max_steps=1", "compile_options.dynamic=false", "compile_options.backend=aot_eager"])
    assert compile_options_for(cfg, "cpu") == {"dynamic": False, "backend": "aot_eager"}
    assert compile_options_for(cfg, "cuda") == {"mode": "max-autotune-no-cudagraphs", "dynamic": False,
                                                "backend": "aot_eager"}
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'compile_options.fulgraph'")):
        load_train_config(None, ["max_steps=1", "compile_options={fulgraph: true}"])
    with pytest.raises(ConfigError, match=re.escape("compile_options.fullgraph: expected true/false, got 'sometimes'")):
        load_train_config(None, ["max_steps=1", "compile_options.fullgraph=sometimes"])


@pytest.mark.parametrize("override, message", [
    ("profile.steps=[3, 2]", "profile.steps: [first, last] with first <= last, got [3, 2]"),
    ("profile.steps=[3]", "profile.steps: [first, last] with first <= last, got [3]"),
    ("profile.steps=[5, 21]", "profile.steps: [5, 21] ends after the run's last step (max_steps=20)"),
    ("profile.steps=[0, 2]", "profile.steps"),
    ("observe.straggler_ratio=1", "observe.straggler_ratio"),
])
def test_profiled_steps_lie_within_the_run_and_the_straggler_ratio_above_1(override, message):
    from huginn_ray.train.config import load_train_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config(None, ["max_steps=20", override])
    cfg = load_train_config(None, ["max_steps=20", "profile={steps: [5, 20], memory_snapshot: true}"])
    assert cfg.profile.steps == [5, 20] and cfg.profile.memory_snapshot
