"""Outer optimizers, IsoLoCo and OuterStep: formulas, equivalences, checkpoint round trips."""

import pytest
import safetensors.torch
import torch

from isoloco import merge_config, merge_functions
from isoloco.comm import LocalCommunicator
from isoloco.errors import ConfigError
from isoloco.ortho import IsoSettings, iso_correct
from isoloco.outer import IsoLoCo, OuterConfig, OuterStep, validate_combination

SHAPES = {"attn.weight": (6, 4), "mlp.weight": (5, 7), "norm.weight": (4,)}
WORKERS = 3


def make_params(dtype=torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))) for name, shape in SHAPES.items()]


def make_round_deltas(round: int, dtype=torch.float32) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + round)
    return {
        name: [torch.randn(shape, generator=g, dtype=dtype) for _ in range(WORKERS)] for name, shape in SHAPES.items()
    }


def outer_step(params, rule="mean", seed=0, merge_knobs=None, **outer) -> OuterStep:
    cfg = merge_config.MergeConfig(rule=rule, **(merge_knobs or {}))
    return OuterStep(params, cfg, OuterConfig(**outer), LocalCommunicator(WORKERS), seed=seed)


def snapshot(params) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in params}


# ------------------------------------------------------------------------ plain optimizers


def test_nesterov_matches_the_formula():
    params = make_params(torch.float64)
    theta = snapshot(params)
    lr, mu = 0.7, 0.9
    step = outer_step(params, optimizer="nesterov", lr=lr, momentum=mu)
    buffers = {}
    for t in range(3):
        deltas = make_round_deltas(t, torch.float64)
        step.step(deltas, round=t)
        for name in SHAPES:
            g = sum(deltas[name]) / WORKERS
            buffers[name] = mu * buffers[name] + g if name in buffers else g  # b ← μb + g
            theta[name] = theta[name] - lr * (g + mu * buffers[name])  # θ ← θ − η(g + μb)
    for name, p in params:
        torch.testing.assert_close(p.detach(), theta[name], rtol=1e-12, atol=1e-12)
        assert p.grad is None


def test_sgd_is_a_scaled_mean_step():
    params = make_params(torch.float64)
    theta = snapshot(params)
    deltas = make_round_deltas(0, torch.float64)
    outer_step(params, optimizer="sgd", lr=1.6, momentum=0.9).step(deltas, round=0)
    for name, p in params:
        torch.testing.assert_close(p.detach(), theta[name] - 1.6 * sum(deltas[name]) / WORKERS)


# -------------------------------------------------------------------------------- IsoLoCo


def run_rounds(optimizer, params, grads_for_round, rounds=3):
    for t in range(rounds):
        for (name, p), grad in zip(params, grads_for_round(t)):
            p.grad = grad
        optimizer.step()


def test_isoloco_gradient_placement_is_iso_c_merge_then_torch_nesterov():
    """The paper's IsoLoCo two ways: IsoLoCo on the mean, or Iso-C merge + SGD(nesterov)."""
    isoloco_params, sgd_params = make_params(), make_params()
    isoloco = IsoLoCo([p for _, p in isoloco_params], lr=1.8, momentum=0.8, placement="gradient")
    sgd = torch.optim.SGD([p for _, p in sgd_params], lr=1.8, momentum=0.8, nesterov=True)
    run_rounds(isoloco, isoloco_params, lambda t: [merge_functions.mean(d) for d in make_round_deltas(t).values()])
    run_rounds(sgd, sgd_params, lambda t: [merge_functions.iso_c(d, IsoSettings(ortho="auto")) for d in make_round_deltas(t).values()])
    for (_, a), (_, b) in zip(isoloco_params, sgd_params):
        assert torch.equal(a, b)


def test_isoloco_update_placement_matches_the_formula():
    params = make_params(torch.float64)
    theta = snapshot(params)
    lr, mu = 1.8, 0.8
    optimizer = IsoLoCo([p for _, p in params], lr=lr, momentum=mu, placement="update")
    grads = lambda t: [merge_functions.mean(d) for d in make_round_deltas(t, torch.float64).values()]  # noqa: E731
    run_rounds(optimizer, params, grads)
    buffers = {}
    for t in range(3):
        for name, g in zip(SHAPES, grads(t)):
            buffers[name] = mu * buffers[name] + g if name in buffers else g
            update = g + mu * buffers[name]
            theta[name] = theta[name] - lr * (iso_correct(update) if update.ndim == 2 else update)
    for name, p in params:
        torch.testing.assert_close(p.detach(), theta[name], rtol=1e-12, atol=1e-12)


def test_isoloco_excluded_group_is_plain_nesterov():
    params, reference = make_params(), make_params()
    optimizer = IsoLoCo([dict(params=[p for _, p in params], iso=False)], lr=0.5, momentum=0.9)
    sgd = torch.optim.SGD([p for _, p in reference], lr=0.5, momentum=0.9, nesterov=True)
    grads = lambda t: [merge_functions.mean(d) for d in make_round_deltas(t).values()]  # noqa: E731
    run_rounds(optimizer, params, grads)
    run_rounds(sgd, reference, grads)
    for (_, a), (_, b) in zip(params, reference):
        assert torch.equal(a, b)


def test_isoloco_fast_path_and_user_errors():
    params = make_params()
    IsoLoCo([p for _, p in params], settings=IsoSettings(ortho="newton_schulz", scale="rms"))  # accepted
    with pytest.raises(ValueError, match="placement"):
        IsoLoCo([p for _, p in params], placement="before")
    with pytest.raises(ValueError, match="momentum"):
        IsoLoCo([p for _, p in params], momentum=1.0)


# ------------------------------------------------------------------------------ OuterStep


def test_outer_step_with_update_placement_aggregates_by_mean_and_corrects_after_momentum():
    params, reference = make_params(), make_params()
    step = outer_step(params, rule="iso_c", optimizer="nesterov", lr=1.8, momentum=0.8, iso_placement="update")
    assert step.merger.cfg.rule == "mean"
    optimizer = IsoLoCo([p for _, p in reference], lr=1.8, momentum=0.8, placement="update")
    for t in range(2):
        step.step(make_round_deltas(t), round=t)
    run_rounds(optimizer, reference, lambda t: [merge_functions.mean(d) for d in make_round_deltas(t).values()], rounds=2)
    for (_, a), (_, b) in zip(params, reference):
        assert torch.equal(a, b)


def test_outer_step_update_placement_honours_exclude():
    params = make_params()
    step = outer_step(
        params, rule="iso_c", merge_knobs=dict(exclude=["attn.*"]), lr=1.0, momentum=0.5, iso_placement="update"
    )
    excluded = [g for g in step.optimizer.param_groups if not g["iso"]]
    assert [p for g in excluded for p in g["params"]] == [params[0][1]]


def test_outer_step_leaves_deltas_alone():
    deltas = make_round_deltas(0)
    copies = {name: [d.clone() for d in ds] for name, ds in deltas.items()}
    outer_step(make_params(), rule="ties").step(deltas, round=0)
    assert all(torch.equal(a, b) for name in deltas for a, b in zip(deltas[name], copies[name]))


def test_outer_step_checks_the_parameter_names():
    deltas = make_round_deltas(0)
    del deltas["norm.weight"]
    with pytest.raises(ValueError, match="missing \\['norm.weight'\\]"):
        outer_step(make_params()).step(deltas, round=0)


@pytest.mark.parametrize(
    "rule, outer",
    [
        ("dare", dict(optimizer="nesterov", lr=0.7, momentum=0.9)),
        ("iso_c", dict(optimizer="nesterov", lr=1.8, momentum=0.8, iso_placement="update")),
        ("iso_cts", dict(optimizer="sgd", lr=3.1)),
        ("ties", dict(optimizer="nesterov", lr=0.7, momentum=0.9)),
    ],
)
def test_state_dict_round_trip_continues_bit_identically(rule, outer):
    params = make_params()
    original = outer_step(params, rule=rule, seed=7, **outer)
    for t in range(2):
        original.step(make_round_deltas(t), round=t)
    saved_params = snapshot(params)
    # Through safetensors, as a checkpoint would store it.
    saved_state = safetensors.torch.load(safetensors.torch.save(original.state_dict()))
    for t in range(2, 4):
        original.step(make_round_deltas(t), round=t)

    resumed_params = [(name, torch.nn.Parameter(saved_params[name].clone())) for name in SHAPES]
    resumed = outer_step(resumed_params, rule=rule, seed=7, **outer)
    resumed.load_state_dict(saved_state)
    for t in range(2, 4):
        resumed.step(make_round_deltas(t), round=t)
    for (_, a), (_, b) in zip(params, resumed_params):
        assert torch.equal(a, b)


def test_state_dict_layout():
    params = make_params()
    step = outer_step(params, rule="dare")
    assert step.state_dict() == {}  # nothing before the first step
    step.step(make_round_deltas(0), round=0)
    state = step.state_dict()
    assert set(state) == {f"momentum_buffer.{name}" for name in SHAPES}  # DARE's masks need no state
    # A snapshot, not a view of live state.
    state["momentum_buffer.attn.weight"].zero_()
    assert step.state_dict()["momentum_buffer.attn.weight"].abs().sum() > 0
    with pytest.raises(ValueError, match="unexpected outer state key"):
        step.load_state_dict({"momentum_buffer.missing.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        step.load_state_dict({"momentum_buffer.attn.weight": torch.zeros(2)})


# -------------------------------------------------------------------------------- config


def test_update_placement_needs_iso_c():
    with pytest.raises(ConfigError, match="merge.rule=iso_c"):
        validate_combination(merge_config.MergeConfig(rule="ties"), OuterConfig(iso_placement="update"))
    validate_combination(merge_config.MergeConfig(rule="iso_c"), OuterConfig(iso_placement="update"))
    with pytest.raises(ConfigError, match="iso_placement"):
        outer_step(make_params(), rule="mean", iso_placement="update")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(optimizer="adam"), "outer.optimizer"),
        (dict(lr=0.0), "outer.lr"),
        (dict(momentum=1.0), "outer.momentum"),
        (dict(momentum=0.0), "outer.optimizer=sgd"),
        (dict(iso_placement="before"), "outer.iso_placement"),
    ],
)
def test_outer_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        OuterConfig(**overrides).validate()


def test_outer_config_defaults():
    cfg = OuterConfig()
    cfg.validate()
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.iso_placement) == ("nesterov", 0.7, 0.9, "gradient")
    OuterConfig(optimizer="sgd", momentum=0.0).validate()


def test_isoloco_state_dict_holds_plain_values_that_torch_load_reads(tmp_path):
    params = make_params()
    optimizer = IsoLoCo([p for _, p in params], settings=IsoSettings(ortho="newton_schulz", scale="rms"))
    for _, p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "outer.pt")
    state = torch.load(tmp_path / "outer.pt")  # weights_only, torch's default
    assert (state["param_groups"][0]["ortho"], state["param_groups"][0]["scale"]) == ("newton_schulz", "rms")
    again = IsoLoCo([p for _, p in params])
    again.load_state_dict(state)
    assert again.param_groups[0]["ortho"] == "newton_schulz"
