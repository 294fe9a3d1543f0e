"""Stragglers and faults: workers of unequal speed, token weighting, late workers
dropped or carried, checked against hand-computed merges and plain runs."""

import logging
import subprocess
import sys
import threading

import pytest
import torch
import yaml

from isoloco import merge_functions, report
from isoloco.comm import LocalCommunicator
from isoloco.config import resolve, to_dict
from isoloco.train_config import FaultsConfig
from isoloco.errors import ConfigError
from isoloco.merge import Merger
from isoloco.merge_config import MergeConfig, Participation
from isoloco.metrics import read_metrics
from isoloco.rundir import CONFIG_FILE
from isoloco.sync.handles import run_to_end
from isoloco.trainer import Trainer

import helpers
from helpers import ONE_THREAD_ENV, SMALL_ARGS, ProcessGroup

SMALL = {**helpers.SMALL, "workers": 4, "steps": 6, "inner_steps": 3, "eval_every": 6}
#: The mean, then SGD outer steps with lr 1 and no momentum: θ_{t+1} = θ_t − merged, easy by hand.
PLAIN_OUTER = {"method": "diloco", "outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0}
RULE_NAMES = ["mean", "ties", "dare", "tsv", "iso_c", "iso_cts"]


def deltas(workers: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for _ in range(workers)]


def merged(rule: str, ds: list[torch.Tensor], participation: Participation | None = None, **knobs) -> torch.Tensor:
    m = Merger(MergeConfig(rule=rule, **knobs), LocalCommunicator(len(ds)), seed=3)
    return run_to_end(m.start({"w": ds}, round=1, participation=participation).steps)["w"]


# -- the merge engine: weights and partial participation -----------------------------------------


def test_weighted_mean_is_the_token_weighted_average():
    ds = deltas(4, (5, 3))
    weights = (6.0, 3.0, 6.0, 1.0)
    expected = sum(w * d for w, d in zip(weights, ds)) / sum(weights)
    torch.testing.assert_close(merged("mean", ds, Participation((0, 1, 2, 3), weights)), expected,
                               rtol=1e-6, atol=1e-7)
    # Iso-C orthogonalises the weighted mean itself.
    torch.testing.assert_close(merged("iso_c", ds, Participation((0, 1, 2, 3), weights)),
                               merge_functions.iso_c([expected]), rtol=1e-5, atol=1e-6)


def test_weighted_ties_averages_the_agreeing_entries_by_weight():
    ds = [torch.tensor([[1.0, -2.0], [3.0, 0.5]]), torch.tensor([[2.0, 1.0], [-1.0, 0.25]]),
          torch.tensor([[-4.0, -1.0], [2.0, 1.0]])]
    weights = (1.0, 2.0, 1.0)
    c = [len(weights) * w / sum(weights) for w in weights]  # every delta is scaled by c_r
    scaled = [cr * d for cr, d in zip(c, ds)]
    sign = torch.where(sum(scaled) >= 0, 1.0, -1.0)  # density 1: nothing trimmed
    agree = [torch.sign(d) == sign for d in ds]
    expected = sum(s * a for s, a in zip(scaled, agree)) / sum(cr * a for cr, a in zip(c, agree))
    got = merged("ties", ds, Participation((0, 1, 2), weights), density=1.0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_equal_weights_merge_bit_for_bit_as_no_weights(rule):
    ds = deltas(4, (12, 8), seed=1)
    plain = merged(rule, ds)
    assert torch.equal(merged(rule, ds, Participation((0, 1, 2, 3), (6.0,) * 4)), plain)
    assert torch.equal(merged(rule, ds, Participation((0, 1, 2, 3))), plain)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_a_partial_merge_is_the_merge_of_the_workers_that_arrived(rule):
    """Workers 1 and 3 of 4 missing: the rule built for the 2 that arrived (mean divisor, TSV's
    k, Iso-CTS's split), with their own global ids (DARE's masks)."""
    ds = deltas(4, (12, 8), seed=2)
    alone = Merger(MergeConfig(rule=rule), LocalCommunicator(worker_ids=[0, 2]), seed=3).merge("w", [ds[0], ds[2]], 1)
    assert torch.equal(merged(rule, ds, Participation((0, 2))), alone)
    if rule == "mean":
        torch.testing.assert_close(alone, (ds[0] + ds[2]) / 2, rtol=0, atol=0)


@pytest.mark.parametrize("rule", ["tsv", "iso_cts", "dare"])
def test_weighted_factors_are_the_factors_of_the_scaled_deltas(rule):
    """TSV, Iso-CTS (and DARE): worker r's delta enters scaled by R·w_r/Σw."""
    ds = deltas(3, (12, 8), seed=4)
    weights = (4.0, 2.0, 2.0)
    scaled = [3 * w / sum(weights) * d for w, d in zip(weights, ds)]
    torch.testing.assert_close(merged(rule, ds, Participation((0, 1, 2), weights)), merged(rule, scaled),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["mean", "ties", "tsv", "iso_cts"])
def test_missing_workers_merge_alike_in_every_layout(rule):
    """2 simulated processes x 2 workers, workers 1 and 2 missing (one of each process), weighted:
    the sums skip them and the gathers drop their blocks, as one process of 4 does."""
    ds = deltas(4, (12, 8), seed=5)
    participation = Participation((0, 3), (3.0, 6.0))
    cfg = MergeConfig(rule=rule)
    expected = merged(rule, ds, participation)
    comms = ProcessGroup(2).communicators(workers_per_process=2)
    results = [None, None]

    def run(rank: int) -> None:
        local = [ds[i] for i in comms[rank].local_worker_ids]
        steps = Merger(cfg, comms[rank], seed=3).start({"w": local}, round=1, participation=participation).steps
        results[rank] = run_to_end(steps)["w"]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)


def test_participation_is_checked():
    with pytest.raises(ValueError, match="distinct worker ids"):
        Participation((2, 1)).scales(4)
    with pytest.raises(ValueError, match="one positive weight per arrived worker"):
        Participation((0, 1), (1.0,)).scales(4)


# -- training: speeds, weights, late workers ------------------------------------------------------


def train(tmp_path, name: str, hooks=(), **overrides) -> Trainer:
    trainer = Trainer(resolve(None, {**SMALL, **overrides}), tmp_path / name, progress=False)
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    trainer.after_turn.extend(hooks)
    trainer.run()
    return trainer


def test_equal_speeds_train_bit_for_bit_as_none(tmp_path):
    plain = train(tmp_path, "plain", method="tsv")
    equal = train(tmp_path, "equal", method="tsv", worker_speeds="2,2", **{"merge.weighting": "tokens"})
    for ours, theirs in zip(equal.global_params, plain.global_params):
        assert torch.equal(ours, theirs)
    assert [m["train_loss"] for m in read_metrics(equal.out_dir / "metrics.jsonl")] == [
        m["train_loss"] for m in read_metrics(plain.out_dir / "metrics.jsonl")]


def test_a_slow_worker_takes_the_first_steps_of_its_round_on_its_own_rows(tmp_path):
    """Speeds 1, 0.5 cycled over 4 workers, H = 4: workers 1 and 3 take 2 steps a round, the
    round's first two, at those steps' learning rates and on their own part of those batches."""
    cfg = resolve(None, {**SMALL, "steps": 8, "inner_steps": 4, "eval_every": 8, "worker_speeds": "1,0.5"})
    out = tmp_path / "run"
    out.mkdir()
    trainer = Trainer(cfg, out, progress=False)
    rows, steps = [], {}
    original = trainer.algorithm.rows

    def recorded(step, worker):
        rows.append((step, worker.index))
        return original(step, worker)

    def counted(index, original_step):
        def step(at):
            steps.setdefault(index, []).append(at)
            return original_step(at)
        return step

    trainer.algorithm.rows = recorded
    for worker in trainer.workers:
        worker.optimizer.step = counted(worker.index, worker.optimizer.step)
    trainer.run()
    assert steps == {0: list(range(8)), 1: [0, 1, 4, 5], 2: list(range(8)), 3: [0, 1, 4, 5]}
    assert sorted(rows) == sorted((s, w) for w, taken in steps.items() for s in taken)
    records = [m for m in read_metrics(out / "metrics.jsonl") if "worker_steps" in m]
    assert [(m["worker_steps"], m["workers_merged"]) for m in records] == [([4, 2, 4, 2], 4)] * 2
    # Tokens are those trained: each worker-step is a worker's 2 rows of 32 tokens; a skipped step trains none.
    taken = [at for at_steps in steps.values() for at in at_steps]
    assert [m["tokens"] for m in read_metrics(out / "metrics.jsonl")] == [
        64 * sum(at < step for at in taken) for step in range(1, 9)]
    summary = trainer.summary()
    assert (summary["tokens"], summary["tokens_scheduled"]) == (64 * len(taken), 8 * 8 * 32) == (1536, 2048)
    # A step's loss is the mean over the workers that took it: all four, then the fast two.
    assert all(m["train_loss"] == m["train_loss"] for m in read_metrics(out / "metrics.jsonl"))


def capture_deltas(store: dict):
    """An `after_turn` hook keeping each worker's delta of each round."""
    def hook(worker, start, end):
        store[(start, worker.index)] = [d.clone() for d in worker.delta]
    return hook


def seed_where(rate: float, wanted, rounds: int = 2, workers: int = 4) -> int:
    """The first seed whose late draws (round by round, worker by worker) satisfy `wanted`."""
    faults = FaultsConfig(late_rate=rate)
    for seed in range(1000):
        late = [[faults.is_late(seed, r, w) for w in range(workers)] for r in range(rounds)]
        if wanted(late):
            return seed
    raise AssertionError("no seed below 1000 draws that")


def test_late_draws_are_seeded_per_round_and_worker():
    faults = FaultsConfig(late_rate=0.3)
    draws = [faults.is_late(7, r, w) for r in range(200) for w in range(4)]
    assert draws == [faults.is_late(7, r, w) for r in range(200) for w in range(4)]
    assert 0.25 < sum(draws) / len(draws) < 0.35
    assert draws != [faults.is_late(8, r, w) for r in range(200) for w in range(4)]
    assert not any(FaultsConfig(late_rate=0.0).is_late(7, r, 0) for r in range(50))


def test_a_late_workers_delta_is_dropped_and_the_others_averaged(tmp_path):
    seed = seed_where(0.4, lambda late: sum(late[0]) == 1 and not any(late[1]))
    late = next(w for w in range(4) if FaultsConfig(late_rate=0.4).is_late(seed, 0, w))
    store = {}
    trainer = train(tmp_path, "drop", [capture_deltas(store)], seed=seed, steps=3, eval_every=3,
                    **{"faults.late_rate": 0.4}, **PLAIN_OUTER)
    initial = Trainer(trainer.cfg, tmp_path / "unused", progress=False).global_params
    arrived = [w for w in range(4) if w != late]
    for i, (before, after) in enumerate(zip(initial, trainer.global_params)):
        expected = before - sum(store[(0, w)][i] for w in arrived) / 3
        torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-6)
    record = [m for m in read_metrics(trainer.out_dir / "metrics.jsonl") if "workers_merged" in m][0]
    assert record["workers_merged"] == 3 and record["worker_steps"] == [3] * 4
    assert record["late_workers"] == [late] and "carried_joined" not in record  # nothing is carried
    # The bytes sent follow the three workers who sent; each sends the whole model once (float32).
    assert record["bytes_sent"] == 3 * record["bytes_per_worker"] == 3 * 4 * trainer.num_params
    # Its inner optimizer state is kept (torchft's replica that misses a commit keeps its own).
    assert trainer.workers[late].optimizer.state_dicts()[0]["state"]


def test_a_carried_delta_joins_the_next_merge_down_weighted(tmp_path):
    seed = seed_where(0.4, lambda late: sum(late[0]) == 1 and not any(late[1]))
    late = next(w for w in range(4) if FaultsConfig(late_rate=0.4).is_late(seed, 0, w))
    store = {}
    overrides = {"seed": seed, "faults.late_rate": 0.4, "faults.late": "carry", "faults.stale_weight": 0.25,
                 **PLAIN_OUTER}
    trainer = train(tmp_path, "carry", [capture_deltas(store)], **overrides)
    initial = Trainer(trainer.cfg, tmp_path / "unused", progress=False).global_params
    arrived = [w for w in range(4) if w != late]
    for i, (before, after) in enumerate(zip(initial, trainer.global_params)):
        round0 = sum(store[(0, w)][i] for w in arrived) / 3
        round1 = (sum(store[(3, w)][i] for w in range(4)) + 0.25 * store[(0, late)][i]) / 4
        torch.testing.assert_close(after, before - round0 - round1, rtol=1e-5, atol=1e-6)
    records = [m for m in read_metrics(trainer.out_dir / "metrics.jsonl") if "workers_merged" in m]
    assert [(m["workers_merged"], m["late_workers"], m["carried_joined"]) for m in records] == [
        (3, [late], []), (4, [], [late])]
    assert [m["bytes_sent"] for m in records] == [3 * 4 * trainer.num_params, 4 * 4 * trainer.num_params]


def test_a_delta_carried_two_rounds_is_down_weighted_once_per_round_it_waited(tmp_path):
    """Late in rounds 0 and 1, on time in round 2: its round-0 delta joins at w², its round-1 delta at w."""
    seed = seed_where(0.4, lambda late: sum(late[0]) == 1 and late[1] == late[0] and not any(late[2]), rounds=3)
    late = next(w for w in range(4) if FaultsConfig(late_rate=0.4).is_late(seed, 0, w))
    store = {}
    overrides = {"seed": seed, "faults.late_rate": 0.4, "faults.late": "carry", "faults.stale_weight": 0.25,
                 "steps": 9, "eval_every": 9, **PLAIN_OUTER}
    trainer = train(tmp_path, "carry-twice", [capture_deltas(store)], **overrides)
    initial = Trainer(trainer.cfg, tmp_path / "unused", progress=False).global_params
    arrived = [w for w in range(4) if w != late]
    for i, (before, after) in enumerate(zip(initial, trainer.global_params)):
        round0 = sum(store[(0, w)][i] for w in arrived) / 3
        round1 = sum(store[(3, w)][i] for w in arrived) / 3
        carried = 0.25 ** 2 * store[(0, late)][i] + 0.25 * store[(3, late)][i]
        round2 = (sum(store[(6, w)][i] for w in range(4)) + carried) / 4
        torch.testing.assert_close(after, before - round0 - round1 - round2, rtol=1e-5, atol=1e-6)
    records = [m for m in read_metrics(trainer.out_dir / "metrics.jsonl") if "workers_merged" in m]
    assert [(m["workers_merged"], m["late_workers"], m["carried_joined"]) for m in records] == [
        (3, [late], []), (3, [late], []), (4, [], [late])]


def test_a_round_nobody_arrives_in_leaves_the_model_unchanged(tmp_path, caplog):
    seed = seed_where(0.9, lambda late: all(late[0]), rounds=1, workers=2)
    with caplog.at_level(logging.WARNING, logger="isoloco"):
        trainer = train(tmp_path, "nobody", seed=seed, workers=2, steps=3, eval_every=3,
                        **{"faults.late_rate": 0.9, "faults.late": "carry"})
    initial = Trainer(trainer.cfg, tmp_path / "unused", progress=False).global_params
    assert all(torch.equal(a, b) for a, b in zip(initial, trainer.global_params))
    assert [r.message for r in caplog.records if "no worker arrived" in r.message] == [
        "round 0: no worker arrived before the deadline (faults.late_rate=0.9); the global model is unchanged"]
    assert read_metrics(trainer.out_dir / "metrics.jsonl")[-1]["workers_merged"] == 0
    assert any(d.abs().sum() > 0 for d in trainer.workers[0].carry)  # kept for the next round


class Stop(Exception):
    pass


def test_a_resumed_run_with_carried_deltas_equals_an_uninterrupted_one(tmp_path):
    """Killed after the checkpoint at step 6, which holds a carried delta (a worker late in round 1)."""
    seed = seed_where(0.4, lambda late: any(late[1]) and not all(late[1]), rounds=4)
    overrides = {"seed": seed, "steps": 12, "eval_every": 6, "checkpoint_every": 6, "method": "isoloco",
                 "worker_speeds": "1,0.5", "merge.weighting": "tokens", "faults.late_rate": 0.4,
                 "faults.late": "carry"}
    reference = train(tmp_path, "reference", **overrides)

    def stop(worker, start, end):
        if start == 6:
            raise Stop

    with pytest.raises(Stop):
        train(tmp_path, "killed", [stop], **overrides)
    resumed = Trainer(resolve(None, {**SMALL, **overrides}), tmp_path / "killed", progress=False)
    resumed.run(resume=True)
    for ours, theirs in zip(resumed.global_params, reference.global_params):
        assert torch.equal(ours, theirs)
    ours, theirs = (read_metrics(run / "metrics.jsonl") for run in (tmp_path / "killed", reference.out_dir))
    assert [m["train_loss"] for m in ours] == [m["train_loss"] for m in theirs]
    assert [m.get("workers_merged") for m in ours] == [m.get("workers_merged") for m in theirs]


def test_speeds_work_with_overlap(tmp_path):
    """H = 4, τ = 1, speeds 1 and 0.5: every turn (4 or 2 steps) lands the update in flight
    before its second step, and the slow workers' deltas hold their own progress."""
    store = {}
    trainer = train(tmp_path, "overlap", [capture_deltas(store)], steps=8, inner_steps=4, eval_every=8,
                    method="isoloco", worker_speeds="1,0.5", **{"outer.overlap_steps": 1})
    records = [m for m in read_metrics(trainer.out_dir / "metrics.jsonl") if "worker_steps" in m]
    assert [m["worker_steps"] for m in records] == [[4, 2, 4, 2]] * 2
    assert all(torch.isfinite(p).all() for p in trainer.global_params)
    assert all(d.abs().sum() > 0 for d in store[(4, 1)] if d.ndim == 2)


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, words", [
    ({"worker_speeds": "1,0"}, "worker_speeds=1,0 is not allowed: every speed must be a number > 0"),
    ({"worker_speeds": "1,-2"}, "every speed must be a number > 0"),
    ({"worker_speeds": "1,x"}, "expected numbers separated by commas"),
    ({"faults.late_rate": 1}, "faults.late_rate=1.0 is not allowed: it must be in [0, 1)"),
    ({"faults.late_rate": -0.1}, "it must be in [0, 1)"),
    ({"faults.late": "carry", "on_bad_worker": "drop"}, "faults.late=carry is not allowed with on_bad_worker=drop"),
    ({"method": "dp", "worker_speeds": "1,0.5"}, "worker_speeds=1,0.5 is not allowed with algorithm=dp"),
    ({"method": "dp", "faults.late_rate": 0.2}, "faults.late_rate=0.2 is not allowed with algorithm=dp"),
    ({"faults.late_rate": 0.2, "outer.overlap_steps": 1}, "not allowed with outer.overlap_steps=1"),
    ({"faults.late_rate": 0.2, "log.spectra": True}, "not allowed with log.spectra=True"),
    ({"worker_speeds": "1,0.25", "inner_steps": 4, "outer.overlap_steps": 1},
     "worker_speeds=1,0.25 is not allowed with outer.overlap_steps=1: the slowest worker takes 1 of inner_steps=4"),
])
def test_bad_straggler_settings_are_refused(overrides, words):
    with pytest.raises(ConfigError) as refused:
        resolve(None, {**SMALL, **overrides})
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_token_weighting_with_equal_workers_is_allowed():
    assert resolve(None, {**SMALL, "merge.weighting": "tokens"}).merge.weighting == "tokens"


@pytest.mark.multiprocess
def test_the_command_refuses_a_bad_speed_in_one_line_before_any_work(tmp_path):
    done = subprocess.run([sys.executable, "-m", "isoloco", "train", *SMALL_ARGS, "worker_speeds=1,0", "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, env=ONE_THREAD_ENV)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: worker_speeds=1,0 is not allowed: every speed must be a "
                                                "number > 0 (relative speeds, e.g. worker_speeds=1,0.5)"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_report_draws_participation_when_it_varies(tmp_path):
    seed = seed_where(0.4, lambda late: sum(late[0]) == 1, rounds=1)
    runs = [train(tmp_path, "late", seed=seed, steps=3, eval_every=3, **{"faults.late_rate": 0.4}),
            train(tmp_path, "full", steps=3, eval_every=3)]
    for run in runs:  # what `isoloco train` writes beside the metrics
        (run.out_dir / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(run.cfg)))
    results = [report.load_run(run.out_dir) for run in runs]
    assert results[0].participation == ((3, 3),) and results[1].participation == ((3, 4),)
    assert ("participation.png", "Workers merged per round") in report.write_plots(results, tmp_path / "plots")
    assert "participation.png" not in dict(report.write_plots(results[1:], tmp_path / "full-plots"))


def test_runs_that_share_their_rounds_draw_one_participation_line():
    def run(name: str, *merged: int) -> report.RunResult:
        return report.RunResult(name=name, method="diloco", workers=4, inner_steps=3, seed=0, model="tiny", tokens=0,
                                final_val_loss=4.0, unigram_baseline=7.0, wall_time_s=None, cpu_time_s=None, curve=(),
                                participation=tuple((3 * (i + 1), m) for i, m in enumerate(merged)))

    runs = [run("b-drop", 3, 4), run("full", 4, 4), run("a-carry", 3, 4), run("c", 4, 2)]
    assert report.participation_lines(runs) == [
        ("a-carry and 1 more with the same rounds", ((3, 3), (6, 4))), ("c", ((3, 4), (6, 2)))]
