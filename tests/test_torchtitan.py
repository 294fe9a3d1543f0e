"""isoloco's torchtitan recipe (`isoloco.torchtitan`) on a CPU: two replica groups of torchtitan's
fault-tolerant trainer under a torchft lighthouse end bit-identical, and every synchronisation
is isoloco's own `OuterStep` on the pseudo-gradients the groups recorded (a killed group is
tests/test_torchtitan_faults.py).

Each group is one process (`torchtitan_cpu.py`, which makes torchtitan 0.3.0 run without a GPU),
gloo, torchtitan's Llama 3 debug model on short sequences of the embedded corpus. They need the
extra (``pip install -e '.[torchtitan]'``, which ``make install`` does); select them with
``pytest -m torchtitan``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from isoloco.comm import LocalCommunicator
from isoloco.config import resolve
from isoloco.errors import ConfigError
from isoloco.svd import null_rtol
from isoloco.outer import OuterStep
from isoloco.torchtitan.settings import OuterSettings

import torchtitan_cpu
from torchft_groups import JOIN_S

pytestmark = [pytest.mark.torchtitan, pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(torchtitan_cpu.MISSING, reason=torchtitan_cpu.SKIP_REASON)]

#: The runs (torchtitan's 6 steps, a synchronisation every 2): the recipe's defaults, IsoLoCo, and
#: DiLoCo's mean; each against isoloco's own outer step of the named method.
RUNS = {"isoloco": [], "diloco": ["--isoloco.rule", "mean", "--isoloco.lr", "0.7", "--isoloco.momentum", "0.9"]}
ROUNDS = 3
#: Largest σmax/σmin of an applied Iso-C update.
FLAT = 1.001


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("torchtitan-assets")
    torchtitan_cpu.prepare_assets(folder)
    return folder


def train_groups(folder: Path, assets: Path, extra: list[str]) -> None:
    """2 replica groups of the recipe under a lighthouse, each recording its synchronisations
    (``group<r>-sync<round>``) and final parameters (``group<r>``) in `folder`."""
    from isoloco.torchft.replica import start_lighthouse

    server, address = start_lighthouse(min_replicas=2)
    try:
        groups = [torchtitan_cpu.start_group(r, address, assets, folder / f"dump-{r}", extra,
                                             {"ISOLOCO_TT_RECORD": str(folder / f"group{r}"),
                                              "ISOLOCO_TT_OUT": str(folder / f"group{r}")}, folder / f"group{r}.log")
                  for r in range(2)]
        codes = [group.wait(timeout=JOIN_S) for group in groups]
    finally:
        server.shutdown()
    assert codes == [0, 0], [(folder / f"group{r}.log").read_text()[-3000:] for r in range(2)]


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> dict[str, Path]:
    """Each of `RUNS` trained once, when a test first asks for it: method → its folder."""
    trained: dict[str, Path] = {}

    def run(method: str) -> Path:
        if method not in trained:
            trained[method] = tmp_path_factory.mktemp(f"torchtitan-{method}")
            train_groups(trained[method], assets, RUNS[method])
        return trained[method]

    return run


def synchronisations(folder: Path, replica: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(folder / f"group{replica}-sync{round}.safetensors") for round in range(ROUNDS)]


@pytest.mark.parametrize("method", sorted(RUNS))
def test_two_replica_groups_end_bit_identical(runs, method):
    folder = runs(method)
    final = [load_file(folder / f"group{r}.safetensors") for r in range(2)]
    assert final[0].keys() == final[1].keys() and len(final[0]) > 0
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
    last = synchronisations(folder, 0)[-1]
    assert all(torch.equal(value, last[f"after.{name}"]) for name, value in final[0].items())  # synced last


@pytest.mark.parametrize("method", sorted(RUNS))
def test_each_synchronisation_is_isolocos_outer_step_on_the_recorded_pseudo_gradients(runs, method):
    """The oracle: isoloco's `OuterStep` with the named method's settings (its merge, then its
    outer optimizer, in one process) on the pseudo-gradients torchft took in each group gives the
    θ both groups hold after each synchronisation; the momentum carries over in `OuterStep` alone."""
    folder, cfg = runs(method), resolve(None, {"method": method})
    groups = [synchronisations(folder, r) for r in range(2)]
    names = [key.removeprefix("before.") for key in groups[0][0] if key.startswith("before.")]
    params = {name: torch.nn.Parameter(groups[0][0][f"before.{name}"].clone()) for name in names}
    outer = OuterStep(list(params.items()), cfg.merge, cfg.outer, LocalCommunicator(2), cfg.seed)
    for round in range(ROUNDS):
        ours, theirs = groups[0][round], groups[1][round]
        # torchtitan's torchft Manager keeps init_sync=True: at the first synchronisation group 1
        # heals from group 0, its trained weights included, so round 0 merges group 0's alone.
        differ = any(not torch.equal(ours[f"delta.{n}"], theirs[f"delta.{n}"]) for n in names)
        assert differ == (round > 0), round
        with torch.no_grad():
            for name in names:
                assert torch.equal(ours[f"before.{name}"], theirs[f"before.{name}"]), (round, name)
                params[name].copy_(ours[f"before.{name}"])
        outer.step({name: [ours[f"delta.{name}"], theirs[f"delta.{name}"]] for name in names}, round)
        for name in names:
            after = ours[f"after.{name}"]
            assert torch.equal(after, theirs[f"after.{name}"]), (round, name)
            update = after - ours[f"before.{name}"]
            error = torch.linalg.norm(params[name].detach() - after) / torch.linalg.norm(after)
            assert error <= 1e-6 and torch.linalg.norm(update) > 0, (round, name, error.item())


def kept_spectrum(matrix: torch.Tensor) -> torch.Tensor:
    """The singular values of `matrix` (in float64) that Iso-C keeps: those above isoloco's
    numerically null threshold, `null_rtol`·σmax; Iso-C leaves the null directions out."""
    singular = torch.linalg.svdvals(matrix.double())
    return singular[singular > null_rtol(matrix) * singular[0]]


def test_isolocos_first_update_of_every_matrix_has_flat_singular_values(runs):
    """IsoLoCo's first outer update is lr·(1 + μ)·Iso-C(mean): one singular value, repeated in
    every direction the mean pseudo-gradient has (a numerically null one stays null)."""
    first = [synchronisations(runs("isoloco"), r)[0] for r in range(2)]
    matrices = [key.removeprefix("before.") for key, value in first[0].items() if key.startswith("before.")
                and value.ndim == 2]
    assert len(matrices) >= 20  # every weight matrix of the debug model's 6 layers, embeddings and head
    for name in matrices:
        mean = (first[0][f"delta.{name}"] + first[1][f"delta.{name}"]) / 2
        kept = kept_spectrum(first[0][f"before.{name}"] - first[0][f"after.{name}"])
        assert len(kept) == len(kept_spectrum(mean)) and kept[0] / kept[-1] <= FLAT, (name, len(kept),
                                                                                      (kept[0] / kept[-1]).item())


#: Settings the recipe refuses, and the start of the line that says so.
REFUSED = {
    "lr": (["--isoloco.lr", "-1"], "--isoloco.lr=-1.0 is not allowed: it must be > 0"),
    "rule": (["--isoloco.rule", "ties"], "--isoloco.rule=ties is not allowed in torchtitan"),
    "placement": (["--isoloco.placement", "update", "--isoloco.rule", "mean"],
                  "--isoloco.placement=update is not allowed with --isoloco.rule=mean"),
    "semi-sync": (["--fault-tolerance.semi-sync-method", "local_sgd"],
                  "--fault-tolerance.semi-sync-method=local_sgd is not allowed"),
    "enable": (["--fault-tolerance.no-enable"], "--fault-tolerance.enable=False is not allowed"),
}

#: One process (torchtitan imports take seconds) builds both `--config` entries and checks every
#: `REFUSED` setting as torchtitan parses it, printing what it found as JSON.
INSPECT = """
import json, sys
import torchtitan_cpu; torchtitan_cpu.patch_for_cpu()
from torchtitan.config import ConfigManager
from isoloco.errors import ConfigError
from isoloco.svd import null_rtol
from isoloco.torchtitan import config_registry
from isoloco.torchtitan.trainer import check_recipe
found = {"configs": {}, "refused": {}}
for name in ("llama3_isoloco_debugmodel", "llama3_isoloco_178m"):
    config = getattr(config_registry, name)()
    model = config.model_spec.model
    found["configs"][name] = [type(config).__qualname__, config.isoloco.rule, model.dim, len(model.layers),
                              model.vocab_size, config.fault_tolerance.sync_steps, config.training.steps,
                              config.optimizer.param_groups[0].optimizer_kwargs["lr"]]
for key, flags in json.loads(sys.argv[1]).items():
    try:
        check_recipe(ConfigManager().parse_args(["--module", "isoloco.torchtitan", "--config",
                                                 "llama3_isoloco_debugmodel", *flags]))
    except ConfigError as error:
        found["refused"][key] = str(error)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def inspected() -> dict:
    flags = json.dumps({key: extra for key, (extra, _) in REFUSED.items()})
    result = subprocess.run([sys.executable, "-c", INSPECT, flags], cwd=Path(__file__).parent, capture_output=True,
                            text=True, timeout=JOIN_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_config_entries_build_the_debug_model_and_the_178m_shape(inspected):
    assert inspected["configs"] == {
        "llama3_isoloco_debugmodel": ["IsoLoCoTrainer.Config", "iso_c", 256, 6, 2048, 10, 100, 8e-4],
        "llama3_isoloco_178m": ["IsoLoCoTrainer.Config", "iso_c", 1024, 9, 32000, 30, 6750, 0.00138]}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_bad_setting_is_refused_in_one_line_naming_the_flag(inspected, key):
    message = inspected["refused"].get(key, "")
    assert message.startswith(REFUSED[key][1]) and "\n" not in message, message


def test_the_entry_point_exits_2_with_that_line_before_torchft_starts(assets, tmp_path):
    # No lighthouse listens at that address: had torchft started, it would fail otherwise.
    group = torchtitan_cpu.start_group(0, "http://127.0.0.1:1", assets, tmp_path / "dump", REFUSED["lr"][0], {},
                                       tmp_path / "group.log")
    group.wait(timeout=JOIN_S)
    log = (tmp_path / "group.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert group.returncode == 2 and errors == [f"error: {REFUSED['lr'][1]}"], log[-3000:]
    assert "Traceback" not in log


def test_settings_name_the_flags_a_user_typed():
    with pytest.raises(ConfigError) as error:
        OuterSettings(optimizer="nesterov", momentum=0.0).validate()
    assert str(error.value).startswith("--isoloco.momentum=0 is not allowed with --isoloco.optimizer=nesterov")
    with pytest.raises(ConfigError, match=r"^--isoloco.fast=True is not allowed with --isoloco.rule=mean"):
        OuterSettings(rule="mean", fast=True).validate()
    fast = OuterSettings(fast=True, exclude=["*tok_embeddings*"]).merge_config()
    assert (fast.ortho, fast.scale, fast.exclude) == ("newton_schulz", "rms", ["*tok_embeddings*"])


def test_another_torchtitan_version_is_refused_in_one_line(monkeypatch):
    from isoloco.torchtitan import internals

    internals.check_version()  # the pinned one, installed here
    monkeypatch.setattr(internals, "version", lambda package: "0.4.0")
    with pytest.raises(ConfigError) as error:
        internals.check_version()
    message = str(error.value)
    assert message.startswith("torchtitan 0.4.0 is installed, but isoloco's torchtitan recipe supports torchtitan "
                              "0.3.0 only") and "\n" not in message


def test_excluded_matrices_take_plain_nesterov_and_the_others_iso_c():
    from isoloco.ortho import iso_correct
    from isoloco.torchtitan.diloco import fragment_outer_optimizer

    settings = OuterSettings(exclude=["*tok_embeddings*"])
    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    embedding, matrix = (torch.nn.Parameter(torch.zeros(6, 4)) for _ in range(2))
    outer = fragment_outer_optimizer([("tok_embeddings.weight", embedding), ("layers.0.attention.wo.weight", matrix)],
                                     settings)
    embedding.grad, matrix.grad = grad.clone(), grad.clone()
    outer.step()
    first = settings.lr * (1 + settings.momentum)  # Nesterov's first step: u = g + μ·g
    torch.testing.assert_close(embedding.detach(), -first * grad)
    torch.testing.assert_close(matrix.detach(), -first * iso_correct(grad, settings.merge_config().iso))
