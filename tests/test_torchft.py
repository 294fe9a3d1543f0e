"""IsoLoCo and every merge rule inside torchft's DiLoCo: the simulator's numbers (a killed group
is tests/test_torchft_faults.py).

Replica groups are real processes talking through a torchft lighthouse and gloo on 127.0.0.1;
a few tests of the merge in the quorum use a stand-in for torchft's Manager instead.
Select these tests with ``pytest -m torchft`` (they need the extra: ``pip install -e '.[torchft]'``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from isoloco.config import resolve
from isoloco.train_config import TrainConfig
from isoloco.errors import ConfigError
from isoloco.data import load_token_data
from isoloco.merge_config import MergeConfig
from isoloco.merge_functions import ties
from isoloco.model import build_model
from isoloco.torchft import QuorumCommunicator, merge_in_quorum
from isoloco.trainer import Trainer

import helpers
from torchft_groups import HEARTBEAT_MS, JOIN_S, SPAWN, TINY, config, join_groups

pytest.importorskip("torchft", reason="the torchft extra is not installed: pip install -e '.[torchft]'")

from torchft.local_sgd import DiLoCo  # noqa: E402

from isoloco.torchft.replica import (GroupRun, JointInnerStep, model_fragments, run_replica_group,  # noqa: E402
                                     start_lighthouse)

pytestmark = [pytest.mark.torchft, pytest.mark.multiprocess]


#: Outer steps checked against the simulator: IsoLoCo exact and fast, both placements, the mean,
#: and the rules merged by isoloco's collectives in torchft's quorum (Iso-CTS in every run; DARE,
#: TIES and TSV, which take the same path, nightly).
EQUIVALENT = {
    "isoloco": {"method": "isoloco"},
    "isoloco_update": {"method": "isoloco", "outer.iso_placement": "update"},
    "isoloco_fast": {"method": "isoloco_fast"},
    "diloco": {"method": "diloco"},
    "isoloco_muon": {"method": "isoloco_muon"},  # two inner optimizers, stepped as one under torchft
    "dare": {"method": "dare"},
    "ties": {"method": "ties"},
    "tsv": {"method": "tsv"},
    "isocts": {"method": "isocts"},
}

INIT_SYNC = "init_sync"  # the first EQUIVALENT config with torchft's default init_sync=True
EXAMPLE = Path(__file__).parents[1] / "examples" / "torchft_isoloco.py"


def _group(configs: dict[str, TrainConfig], replica: int, lighthouse: str, out: Path) -> None:
    """A replica group's process: train each config in turn (one process start for all), and
    the first once more with torchft's default init_sync=True."""
    torch.set_num_threads(1)
    for name, cfg in configs.items():
        run_replica_group(cfg, replica, lighthouse).save(out / f"{name}-{replica}")
    name, cfg = next(iter(configs.items()))
    run_replica_group(cfg, replica, lighthouse, init_sync=True).save(out / f"{INIT_SYNC}-{replica}")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


QUORUM_NIGHTLY = ("dare", "ties", "tsv")


def equivalent_params() -> list:
    return [pytest.param(name, marks=pytest.mark.nightly) if name in QUORUM_NIGHTLY else name
            for name in sorted(EQUIVALENT)]


@pytest.fixture(scope="module")
def torchft_runs(request, tmp_path_factory) -> dict[str, list[GroupRun]]:
    """The `EQUIVALENT` configs this session checks, trained by 2 torchft replica groups
    (spawned once); the first always, for the init_sync test."""
    out = tmp_path_factory.mktemp("torchft")
    chosen = {item.callspec.params["name"] for item in request.session.items
              if item.originalname == "test_torchft_diloco_equals_the_simulator"}
    configs = {name: config(**overrides) for index, (name, overrides) in enumerate(EQUIVALENT.items())
               if index == 0 or name in chosen}
    load_token_data(next(iter(configs.values())).data)  # prepare the corpus before the groups read it
    server, address = start_lighthouse(min_replicas=2, heartbeat_timeout_ms=HEARTBEAT_MS)
    groups = [SPAWN.Process(target=_group, args=(configs, r, address, out)) for r in range(2)]
    try:
        for group in groups:
            group.start()
        join_groups(groups)
    finally:
        server.shutdown()
    assert [g.exitcode for g in groups] == [0, 0]
    return {name: [GroupRun.load(out / f"{name}-{r}") for r in range(2)] for name in [*configs, INIT_SYNC]}


def simulate(tmp_path: Path, name: str) -> Trainer:
    simulator = Trainer(config(**EQUIVALENT[name]), tmp_path / name, progress=False)
    (tmp_path / name).mkdir()
    simulator.run()
    return simulator


@pytest.mark.parametrize("name", equivalent_params())
def test_torchft_diloco_equals_the_simulator(tmp_path, torchft_runs, name):
    simulator = simulate(tmp_path, name)
    groups = torchft_runs[name]
    for run in groups:
        assert run.steps == list(range(TINY["steps"])) and run.outer_steps == 3
        for (param_name, _), theta in zip(simulator.named_params, simulator.global_params, strict=True):
            assert relative_error(run.params[param_name], theta.detach()) <= 1e-5, param_name
    # Both groups hold the same θ, and it moved away from the initial weights.
    for param_name, value in groups[0].params.items():
        assert torch.equal(value, groups[1].params[param_name])
    cfg = config(**EQUIVALENT[name])
    initial = dict(build_model(cfg.model, load_token_data(cfg.data).vocab_size, cfg.seq_len, cfg.seed).named_parameters())
    assert all(relative_error(value, initial[n].detach()) > 1e-3 for n, value in groups[0].params.items()
               if value.ndim == 2)


def test_torchft_default_init_sync_makes_the_first_round_group_0s_alone(tmp_path, torchft_runs):
    # With init_sync=True the first synchronisation copies group 0's state (its trained
    # weights included) into group 1, so both send group 0's pseudo-gradient: far from the
    # simulator's first outer step, which merges both workers'.
    name = next(iter(EQUIVALENT))
    simulator = simulate(tmp_path, name)
    run = torchft_runs[INIT_SYNC][0]
    assert run.steps == list(range(TINY["steps"]))
    errors = [relative_error(run.params[n], theta.detach())
              for (n, _), theta in zip(simulator.named_params, simulator.global_params)]
    assert statistics.median(errors) > 0.1


class _QuorumOfOne:
    """torchft's Manager as a group alone in its quorum sees it: the sum, or the mean, over the
    quorum is the tensor itself. After `fail_after` all-reduces it records an error, as torchft's
    Manager does when a peer is lost during a collective, and then refuses to commit."""

    _use_async_quorum = False  # DiLoCo needs a synchronous quorum

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.all_reduces = 0

    def allreduce(self, tensor, should_quantize=False, reduce_op=torch.distributed.ReduceOp.AVG):
        self.all_reduces += 1
        return _Finished()

    def errored(self):
        failed = self.fail_after is not None and self.all_reduces > self.fail_after
        return RuntimeError("peer lost") if failed else None

    def should_commit(self) -> bool:
        return self.errored() is None

    def num_participants(self) -> int:
        return 1

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return 0

    def start_quorum(self) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def register_state_dict_fn(self, *args) -> None:
        pass


class _Finished:
    """A collective that has completed."""

    def wait(self) -> bool:
        return True


def _one_round(manager: _QuorumOfOne, merge: MergeConfig, **diloco) -> tuple[dict, dict, dict]:
    """Two linear layers under torchft's DiLoCo (H = 1, outer SGD with lr 1, so θ moves by
    minus the merged pseudo-gradient): θ before, θ_r after the inner step, and θ after the sync."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    ft = DiLoCo(manager, [model], inner, outer, sync_every=1, backup_device=torch.device("cpu"), pin_memory=False,
                **diloco)
    merge_in_quorum(ft, model, merge, seed=0, replica=0)
    with ft:
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        local = {n: (p - 0.5 * p.grad).detach() for n, p in model.named_parameters()}
        inner.step()  # the inner step, then torchft's synchronisation in its post-step hook
    return before, local, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_torchft_steps_on_the_rules_merge_in_place_of_the_mean():
    """Alone in its quorum a group's TIES merge is its own trimmed pseudo-gradient, not the
    pseudo-gradient itself (which the mean would be): torchft's outer step applies the merge."""
    before, local, after = _one_round(_QuorumOfOne(), MergeConfig(rule="ties", density=0.5))
    for name in before:
        merged = ties([before[name] - local[name]], density=0.5)
        assert torch.equal(after[name], before[name] - merged), name
        assert not torch.equal(after[name], local[name]), name  # half the entries were trimmed


def test_a_collective_that_fails_during_the_merge_leaves_the_round_uncommitted():
    # The id exchange succeeds, TIES's first sum of the first tensor fails: the merge sends
    # nothing more (that tensor's second sum and the other tensors' sums are not made), torchft
    # does not commit, and θ is restored for the round to be trained again.
    manager = _QuorumOfOne(fail_after=1)
    before, _, after = _one_round(manager, MergeConfig(rule="ties", bucket_mb=1e-6))  # one bucket per tensor
    assert manager.all_reduces == 2
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_quantised_all_reduce_is_refused_for_the_rules_merged_in_the_quorum():
    with pytest.raises(ConfigError) as error:
        _one_round(_QuorumOfOne(), MergeConfig(rule="dare"), should_quantize=True)
    assert str(error.value).startswith("should_quantize=True is not allowed with merge.rule=dare")
    assert "\n" not in str(error.value)
    _one_round(_QuorumOfOne(), MergeConfig(rule="iso_c"), should_quantize=True)  # the mean's all-reduce may be


def test_parameters_sharded_within_a_group_are_refused_for_the_rules_merged_in_the_quorum(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # A group of one process whose matrix is a DTensor, as FSDP or tensor parallelism leave it.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)),
                                                            [Shard(0)]))
        ft = DiLoCo(_QuorumOfOne(), [model], torch.optim.SGD(model.parameters(), lr=0.1),
                    torch.optim.SGD(model.parameters(), lr=1.0), sync_every=1, pin_memory=False)
        with pytest.raises(ConfigError) as error:
            merge_in_quorum(ft, model, MergeConfig(rule="tsv"), seed=0, replica=0)
    finally:
        dist.destroy_process_group()
    assert str(error.value).startswith("merge.rule=tsv needs whole tensors, but 'weight' is sharded (a DTensor)")
    assert "\n" not in str(error.value)


class _TwinInQuorum(_QuorumOfOne):
    """A quorum of two whose other group was started with this group's worker id."""

    def num_participants(self) -> int:
        return 2

    def allreduce(self, tensor, should_quantize=False, reduce_op=torch.distributed.ReduceOp.AVG):
        tensor[1] = tensor[0]  # what the other group writes at its rank
        return super().allreduce(tensor, should_quantize, reduce_op)


def test_two_groups_that_are_one_worker_are_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        QuorumCommunicator(_TwinInQuorum(), replica=1)
    assert str(error.value) == ("several replica groups in torchft's quorum are worker 1: give each group its own "
                                "replica number")


def test_two_machines_on_distinct_loopback_addresses_train_as_one_job():
    """docs/torchft.md's two-machine recipe, each "machine" an address of its own (127.0.0.2 runs the
    lighthouse and group 0, 127.0.0.3 group 1): both commit every outer step and end equal."""
    import subprocess
    import sys

    from isoloco.launch import free_port

    tiny = [*helpers.SMALL_ARGS, "steps=6", "inner_steps=2"]
    port = free_port("127.0.0.2")
    env = {**helpers.ONE_THREAD_ENV, "RUST_LOG": "error"}  # torchft's lighthouse and managers: errors only
    machine_a = subprocess.Popen([sys.executable, str(EXAMPLE), *tiny, "--groups", "0", "--host", "127.0.0.2",
                                  "--lighthouse-bind", f"127.0.0.2:{port}"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        header = machine_a.stdout.readline()  # printed once its lighthouse listens
        assert f"lighthouse http://127.0.0.2:{port}" in header, (header, machine_a.communicate())
        machine_b = subprocess.run([sys.executable, str(EXAMPLE), *tiny, "--groups", "1", "--host", "127.0.0.3",
                                    "--lighthouse", f"http://127.0.0.2:{port}"], env=env, capture_output=True,
                                   text=True, timeout=JOIN_S)
        out_a, err_a = machine_a.communicate(timeout=JOIN_S)
    finally:
        machine_a.kill()
    assert machine_a.returncode == 0 and machine_b.returncode == 0, (err_a, machine_b.stderr)
    finished = [next(line for line in out.splitlines() if line.startswith("outer steps committed"))
                for out in (out_a, machine_b.stdout)]
    assert finished[0].startswith("outer steps committed: [3]; final parameters' sha256: group 0: ")
    assert finished[1].startswith("outer steps committed: [3]; final parameters' sha256: group 1: ")
    assert finished[0].rsplit(": ", 1)[1] == finished[1].rsplit(": ", 1)[1]  # the same θ on both machines


DELAYED = {"steps": 8, "inner_steps": 4}  # 2 fragments: one synchronised every 2 steps


def _delayed_group(cfg: TrainConfig, replica: int, lighthouse: str, out: Path, delay: int) -> None:
    torch.set_num_threads(1)
    run_replica_group(cfg, replica, lighthouse, fragments=2, sync_delay=delay).save(out / f"delay{delay}-{replica}")


@pytest.mark.parametrize("method", ["isoloco", "isocts"])
def test_an_all_reduce_overlapping_an_inner_step_keeps_the_groups_in_step(tmp_path, method):
    """Streaming DiLoCo with IsoLoCo per fragment (or Iso-CTS, merged in the quorum fragment by
    fragment) and torchft's fragment_sync_delay = 1: every synchronisation commits, and the
    fragment synchronised last is the same new θ in both groups, another than without the delay
    (its pseudo-gradient was taken a step earlier)."""
    cfg = config(**DELAYED, method=method)
    load_token_data(cfg.data)
    server, address = start_lighthouse(min_replicas=2, heartbeat_timeout_ms=HEARTBEAT_MS)
    try:
        for delay in (0, 1):
            groups = [SPAWN.Process(target=_delayed_group, args=(cfg, r, address, tmp_path, delay)) for r in range(2)]
            for group in groups:
                group.start()
            join_groups(groups)
            assert [g.exitcode for g in groups] == [0, 0]
    finally:
        server.shutdown()
    runs = {delay: [GroupRun.load(tmp_path / f"delay{delay}-{r}") for r in range(2)] for delay in (0, 1)}
    for run in [*runs[0], *runs[1]]:
        assert run.steps == list(range(8)) and run.outer_steps == 4
    model = build_model(cfg.model, load_token_data(cfg.data).vocab_size, cfg.seq_len, cfg.seed)
    names = {param: name for name, param in model.named_parameters()}
    last = [names[p] for p in model_fragments(model, 2)[-1].parameters()]
    for name in last:
        assert torch.equal(runs[1][0].params[name], runs[1][1].params[name]), name
    assert max(relative_error(runs[1][0].params[n], runs[0][0].params[n]) for n in last) > 1e-4


def test_muon_and_adamw_step_inside_torchfts_hooks():
    """torchft's pre-step hook locks the state against a recovering peer's read and its post-step
    hook unlocks it: every inner optimizer of the worker must step in between."""
    from isoloco.inner import InnerOptimizer

    cfg = config(method="isoloco_muon")
    model = build_model(cfg.model, 512, cfg.seq_len, cfg.seed)
    inner = InnerOptimizer(list(model.named_parameters()), cfg.inner, cfg.steps)
    joint = JointInnerStep(inner)
    locked = []
    joint.register_step_pre_hook(lambda *_: locked.append(True))
    joint.register_step_post_hook(lambda *_: locked.append(False))
    stepped = []
    for optimizer in inner.optimizers:
        def step(*args, _original=optimizer.step, _name=type(optimizer).__name__, **kwargs):
            stepped.append((_name, locked[-1]))
            return _original(*args, **kwargs)
        optimizer.step = step
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    joint.step(0)
    assert stepped == [("Muon", True), ("AdamW", True)] and locked == [True, False]
    assert all(param.grad is None for param in model.parameters())  # the whole inner step ran


def test_a_group_trains_where_its_config_says_and_talks_over_the_matching_backend():
    from isoloco.torchft.replica import check_group_config, check_machine_groups, group_backend, group_device

    cpu = resolve("quick", {"workers": 2, "device": "cpu"})
    assert [group_device(cpu, r) for r in (0, 1)] == [torch.device("cpu")] * 2
    assert group_backend(torch.device("cpu")) == "gloo" and group_backend(torch.device("cuda", 1)) == "nccl"
    check_machine_groups(cpu, [0, 1])  # CPU groups share nothing NCCL would refuse
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda' is not available"):
            check_group_config(resolve("quick", {"workers": 2, "device": "cuda"}), 0, 1)
    # What torchft would silently not carry is refused by the library too, not only by the example.
    for key, value in (("merge.compress", "lowrank"), ("merge.weighting", "tokens"), ("faults.late_rate", 0.3)):
        with pytest.raises(ConfigError, match=f"{key}={value} is not supported under torchft"):
            check_group_config(resolve("quick", {"workers": 2, key: value}), 0, 1)


@pytest.mark.cuda
def test_groups_on_one_machine_get_a_gpu_each_or_are_refused():
    from isoloco.torchft.replica import check_machine_groups, group_device

    cfg = resolve("quick", {"workers": 2 * torch.cuda.device_count() + 1})
    gpus = torch.cuda.device_count()
    assert [group_device(cfg, r) for r in range(gpus)] == [torch.device("cuda", r) for r in range(gpus)]
    check_machine_groups(cfg, list(range(gpus)))
    with pytest.raises(ConfigError, match="would share GPUs"):
        check_machine_groups(cfg, list(range(gpus + 1)))


def test_another_torchft_version_is_refused_in_one_line(monkeypatch):
    from isoloco.torchft import internals

    internals.check_version()  # the pinned one, installed here
    monkeypatch.setattr(internals, "version", lambda package: "0.3.0")
    with pytest.raises(ConfigError) as error:
        merge_in_quorum(object(), torch.nn.Linear(2, 2), MergeConfig(rule="ties"), seed=0, replica=0)
    message = str(error.value)
    assert message.startswith("torchft 0.3.0 is installed, but isoloco's torchft integration supports torchft 0.2.0")
    assert "pip install 'torchft==0.2.0'" in message and "\n" not in message


def test_a_private_torchft_name_that_moved_is_named_in_one_line():
    from isoloco.torchft import internals

    class Moved:  # a DiLoCo whose fragments live elsewhere
        fragments = []

    with pytest.raises(ConfigError) as error:
        merge_in_quorum(Moved(), torch.nn.Linear(2, 2), MergeConfig(rule="ties"), seed=0, replica=0)
    assert str(error.value).startswith(f"torchft {internals.installed_version()}'s Moved has no _fragments")
    assert "\n" not in str(error.value)
