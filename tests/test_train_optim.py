"""ELLISAdam against the reference test vector (§3.5), the three parameter groups and the trapezoid schedule."""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from huginn_ray.train import optim
from huginn_ray.train.config import OptimConfig
from huginn_ray.train.optim import ELLISAdam, adamw_fused, build_optimizer, param_groups, set_lr, trapezoid_lr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from ellis_reference import ReferenceState, reference_step  # noqa: E402  (bench/: the reference is no part of the package)


def huginn_ellis(params, lr=4e-5):
    return ELLISAdam(params, lr=lr, betas=(0.9, 0.95), eps=1e-6, weight_decay=4e-5,
                     update_clipping=True, atan_adam=True, running_init=True, decouple_wd=True)


def test_ellis_adam_reproduces_reference_vector():
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 0.0]))
    opt = huginn_ellis([p])
    opt.param_groups[0]["lr"] = 2e-5  # scheduled lr at half of init_lr: decay factor uses lr / init_lr = 0.5
    before = p.detach().clone()
    p.grad = torch.tensor([0.1, -0.2, 0.0, 1e-3])
    opt.step()
    delta = p.detach() - before
    expected = torch.tensor([-6.4015e-05, 8.4043e-05, -1.0014e-05, -4.3998e-05])
    # fp32 differences near |p| = 1..2 are quantised to ~1e-7
    torch.testing.assert_close(delta, expected, rtol=0, atol=2e-7)


def test_ellis_adam_first_update_is_atan_of_bias_correction():
    p = nn.Parameter(torch.zeros(3))
    opt = ELLISAdam([p], lr=1e-3, atan_adam=True, running_init=True, update_clipping=True)
    p.grad = torch.tensor([3.0, -1e-3, 7.0])
    opt.step()
    step = 1e-3 / 0.1 * math.atan(math.sqrt(1 - 0.95))
    torch.testing.assert_close(p.detach(), torch.tensor([-step, step, -step]))


def test_ellis_adam_update_clipping_limits_rms():
    # second step with a gradient 100x larger than the first: rms(g/sqrt(v)) > 1 shrinks the step.
    p_clip, p_free = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    opts = [ELLISAdam([p_clip], lr=1e-2, update_clipping=True), ELLISAdam([p_free], lr=1e-2)]
    for g in (torch.full((4,), 0.01), torch.full((4,), 1.0)):
        for p, opt in zip((p_clip, p_free), opts):
            p.grad = g.clone()
            opt.step()
    assert p_clip.abs().max() < p_free.abs().max()


def test_ellis_adam_init_lr_survives_state_dict_roundtrip():
    p = nn.Parameter(torch.ones(2))
    opt = huginn_ellis([p])
    p.grad = torch.ones(2)
    opt.step()
    fresh = huginn_ellis([nn.Parameter(torch.ones(2))], lr=1.0)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["init_lr"] == 4e-5
    assert int(fresh.state[fresh.param_groups[0]["params"][0]]["step"]) == 1


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.qkv = nn.Linear(4, 12, bias=False)
        self.attn_proj = nn.Linear(4, 4, bias=False)
        self.norm_1 = nn.Parameter(torch.ones(4))
        self.qk_bias = nn.Parameter(torch.zeros(2, 4))
        self.ln_f = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: must appear once


def test_param_groups_three_groups_no_decay_on_norms_and_biases():
    groups = param_groups(Toy(), weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    assert [g["name"] for g in groups] == ["weights", "embedding", "scale_norm"]
    assert len(by_name["weights"]["params"]) == 2
    assert len(by_name["embedding"]["params"]) == 1
    assert len(by_name["scale_norm"]["params"]) == 4  # norm_1, qk_bias, ln_f.weight, ln_f.bias
    assert by_name["weights"]["weight_decay"] == 0.1
    assert by_name["embedding"]["weight_decay"] == 0.1
    assert by_name["scale_norm"]["weight_decay"] == 0.0
    total = sum(len(g["params"]) for g in groups)
    assert total == len(list(Toy().parameters()))


def test_adamw_is_fused_on_gpus_and_single_tensor_on_cpu(monkeypatch):
    assert (adamw_fused(torch.device("cuda")), adamw_fused(torch.device("cpu"))) == (True, False)
    cfg = OptimConfig(name="AdamW", lr=1e-2, weight_decay=0.1)
    models, optimizers = {}, {}
    for path in ("single-tensor", "fused"):
        # the fused construction, on the CPU's fused kernel: what a GPU worker builds, step counts on the device
        monkeypatch.setattr(optim, "adamw_fused", lambda device, fused=path == "fused": fused)
        torch.manual_seed(0)
        models[path] = Toy()
        optimizers[path] = build_optimizer(models[path], cfg)
        for _ in range(3):
            sum((i + 1) * (p - 0.5).square().sum() for i, p in enumerate(models[path].parameters())).backward()
            optimizers[path].step()
            optimizers[path].zero_grad()
    assert [(o.defaults["fused"], o.defaults["foreach"]) for o in optimizers.values()] == [(False, False), (True, None)]
    steps = {path: {o.state[p]["step"].item() for p in o.state} for path, o in optimizers.items()}
    assert steps == {"single-tensor": {3.0}, "fused": {3.0}}
    for (name, single), fused in zip(models["single-tensor"].named_parameters(), models["fused"].parameters()):
        assert not torch.equal(single, Toy().get_parameter(name))  # the steps moved it
        torch.testing.assert_close(fused, single, rtol=1e-6, atol=1e-7)


def test_param_groups_refuses_unclassified_parameter():
    m = nn.Module()
    m.mystery = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="mystery"):
        param_groups(m, 0.1)


def test_trapezoid_schedule_warmup_constant_cooldown():
    kw = dict(max_lr=4e-5, warmup_steps=4096, cooldown_steps=4096, max_steps=238418, min_lr=0.0)
    assert trapezoid_lr(2, **kw) == pytest.approx(4e-5 * 2 / 4096)  # 1.95e-8, the first used value
    assert trapezoid_lr(4096, **kw) == 4e-5
    assert trapezoid_lr(100_000, **kw) == 4e-5
    assert trapezoid_lr(238418 - 2048, **kw) == pytest.approx(2e-5)
    assert trapezoid_lr(238418, **kw) == 0.0
    assert trapezoid_lr(238418 - 10, **{**kw, "min_lr": 1e-5}) == 1e-5


def test_every_group_follows_schedule_after_state_dict_load():
    model = Toy()
    opt = huginn_ellis(param_groups(model, 4e-5))
    for g in opt.param_groups:
        g["base_lr"] = 1.0
    set_lr(opt, 1e-6)
    reloaded = huginn_ellis(param_groups(Toy(), 4e-5))
    reloaded.load_state_dict(opt.state_dict())
    set_lr(reloaded, 3e-5)
    assert [g["lr"] for g in reloaded.param_groups] == [3e-5, 3e-5, 3e-5]


def test_reference_lr_quirk_switch_reproduces_the_frozen_groups():
    def fresh():
        opt = huginn_ellis(param_groups(Toy(), 4e-5))
        set_lr(opt, 1e-6)
        return opt

    opt = fresh()
    set_lr(opt, 2e-5, reference_quirk=True)
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {"weights": 4e-5, "embedding": 2e-5, "scale_norm": 2e-5}
    set_lr(opt, 3e-5, reference_quirk=True, resumed=True)  # after a resume nothing follows the schedule
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {"weights": 4e-5, "embedding": 2e-5, "scale_norm": 2e-5}
    intended = fresh()
    set_lr(intended, 3e-5, resumed=True)
    assert [g["lr"] for g in intended.param_groups] == [3e-5, 3e-5, 3e-5]


HUGINN_OPTIONS = dict(update_clipping=True, atan_adam=True, running_init=True, decouple_wd=True)


@pytest.mark.parametrize("options", [HUGINN_OPTIONS,
                                     dict(update_clipping=False, atan_adam=False, running_init=False, decouple_wd=False)])
def test_ellis_adam_equals_the_reference_formula_over_10_steps(options):
    """The eager step against the reference formula (bench/ellis_reference.py) on a small model's three groups, under a warmup (lr / init_lr
    changes every step), some clipped steps and a tensor that misses a step: weights within 1e-6."""
    torch.manual_seed(0)
    model, reference = Toy(), Toy()
    reference.load_state_dict(model.state_dict())
    opt = ELLISAdam(param_groups(model, 0.1), lr=1e-2, eps=1e-6, **options)
    ref_groups = [dict(opt.defaults, **g) for g in param_groups(reference, 0.1)]
    ref_states = [[ReferenceState(p) for p in g["params"]] for g in ref_groups]
    for step in range(10):
        lr = 1e-2 * (step + 1) / 10
        for name, p in model.named_parameters():
            grad = torch.randn_like(p) * (10.0 if step % 4 == 3 else 1.0)
            skip = step == 5 and name == "qk_bias"
            p.grad = None if skip else grad
            reference.get_parameter(name).grad = None if skip else grad.clone()
        set_lr(opt, lr)
        opt.step()
        for group, states in zip(ref_groups, ref_states):
            group["lr"] = lr
            reference_step(group, states)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert not torch.equal(p, Toy().get_parameter(name))
        assert (p - ref).abs().max() <= 1e-6, name


def test_the_compiled_step_is_the_eager_step(monkeypatch):
    """`compiled=True` takes `compiled_kernels` (torch.compile of the same two functions; here stood in for by
    the eager functions, wrapped to record the call: compiling costs tens of seconds on CPU, bench/gpu_check.py
    runs the compiled step); None compiles on a GPU, not on the CPU."""
    calls = []

    def recording(fn):
        def call(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return call

    monkeypatch.setattr(optim, "compiled_kernels", lambda: (recording(optim.moments_), recording(optim.update_)))
    torch.manual_seed(0)
    initial = [torch.randn(4, 3), torch.randn(5)]
    params = {mode: [nn.Parameter(t.clone()) for t in initial] for mode in ("eager", "compiled")}
    opts = {mode: ELLISAdam(params[mode], lr=1e-2, **HUGINN_OPTIONS) for mode in params}
    opts["compiled"].compiled = True
    for _ in range(2):
        grads = [torch.randn(4, 3), torch.randn(5)]
        for mode in params:
            for p, g in zip(params[mode], grads):
                p.grad = g.clone()
            opts[mode].step()
    assert calls == ["moments_", "moments_", "update_", "update_"] * 2
    for p, ref in zip(params["compiled"], params["eager"]):
        assert torch.equal(p, ref)


def test_update_clipping_makes_no_host_sync(monkeypatch):
    p = nn.Parameter(torch.randn(4, 4))
    opt = huginn_ellis([p])
    p.grad = torch.randn(4, 4)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("Tensor.item() in the optimizer step"))
    opt.step()


def test_a_resume_under_another_optimizer_is_refused_naming_optim_name():
    from huginn_ray.train.config import OptimConfig
    from huginn_ray.train.optim import apply_config_on_resume, build_optimizer

    model = nn.ModuleDict({"fc": nn.Linear(4, 4, bias=False), "norm": nn.LayerNorm(4)})  # weights, scale_norm
    ellis = build_optimizer(model, OptimConfig(name="ELLISAdam"))
    adamw = build_optimizer(model, OptimConfig(name="AdamW"))
    adamw.load_state_dict(ellis.state_dict())  # what loading an ELLISAdam checkpoint leaves in AdamW's groups
    with pytest.raises(ValueError, match=r"optim.name=AdamW, but the checkpoint's optimizer state is ELLISAdam's"):
        apply_config_on_resume(adamw, OptimConfig(name="AdamW"))
    assert apply_config_on_resume(ellis, OptimConfig(name="ELLISAdam")) == []
    changed = OptimConfig(name="ELLISAdam", lr=1e-3, no_weight_decay_for_bias_and_norm=False, update_clipping=False)
    assert apply_config_on_resume(ellis, changed) == [
        "[huginn] resume: optim.lr 4e-05 -> 0.001 (config)",
        "[huginn] resume: optim.update_clipping True -> False (config)",
        "[huginn] resume: optim.weight_decay of norms and biases (optim.no_weight_decay_for_bias_and_norm) "
        "0.0 -> 4e-05 (config)"]
    assert [(g["init_lr"], g["weight_decay"], g["update_clipping"]) for g in ellis.param_groups] == \
        [(1e-3, 4e-5, False), (1e-3, 4e-5, False)]
