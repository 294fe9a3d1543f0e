"""The training loop: DiLoCo/data-parallel equivalences, every method runs, resume is exact."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from isoloco.config import resolve
from isoloco.methods import METHODS
from isoloco.sync.handles import Sync
from isoloco.sync.inflight import InFlight
from isoloco.trainer import Trainer
import helpers
from helpers import ONE_THREAD_ENV, SMALL_ARGS, assert_close_relative, wait_for

SMALL = {**helpers.SMALL, "steps": 10, "eval_every": 10}


def train(tmp_path: Path, name: str, **overrides) -> Trainer:
    cfg = resolve(None, {**SMALL, **overrides})
    trainer = Trainer(cfg, tmp_path / name, progress=False)
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    trainer.run()
    return trainer


SGD = {"inner.optimizer": "sgd", "inner.lr": 0.2, "inner.grad_clip": 0.0}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_diloco_sgd_h1_equals_data_parallel_sgd(tmp_path, workers):
    dp = train(tmp_path, "dp", method="dp", **SGD)
    diloco = train(tmp_path, "diloco", method="diloco", workers=workers, inner_steps=1,
                   **{"outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0, **SGD})
    assert_close_relative(diloco.global_params, dp.global_params, 1e-6)
    assert diloco.last_val_loss == pytest.approx(dp.last_val_loss, rel=1e-6)
    # Guard against a vacuous pass: training moved the weights.
    initial = train(tmp_path, "untrained", method="dp", steps=1, **{**SGD, "inner.lr": 1e-12})
    assert not torch.allclose(dp.global_params[0], initial.global_params[0])


@pytest.mark.parametrize("inner_steps", [1, 3, 5])
def test_one_worker_outer_sgd_lr1_equals_data_parallel(tmp_path, inner_steps):
    # Same inner settings on both sides (dp clips nothing by default, DiLoCo's inner steps do).
    inner = {"inner.lr": 0.003, "inner.weight_decay": 0.1, "inner.grad_clip": 1.0}
    dp = train(tmp_path, "dp", method="dp", **inner)
    diloco = train(tmp_path, "diloco", method="diloco", workers=1, inner_steps=inner_steps,
                   **{"outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0, **inner})
    assert_close_relative(diloco.global_params, dp.global_params, 1e-5)


# -- overlap: a synchronisation in flight while the next round trains ------------------------

OVERLAP = {"outer.optimizer": "nesterov", "outer.lr": 0.7, "outer.momentum": 0.9}
INNER = {"inner.lr": 0.003, "inner.weight_decay": 0.1, "inner.grad_clip": 1.0}


def test_a_worker_that_keeps_its_own_weights_trains_as_if_alone(tmp_path):
    """α = 1 lands nothing: one worker's turns continue from its own weights (θ_t − Δ_r, up
    to rounding), so its losses are data-parallel training's although θ takes outer steps."""
    dp = train(tmp_path, "dp", method="dp", **INNER)
    alone = train(tmp_path, "alone", method="diloco", workers=1, inner_steps=3,
                  **{**OVERLAP, **INNER, "outer.overlap_steps": 1, "outer.overlap_alpha": 1.0})
    losses = lambda t: [json.loads(line)["train_loss"] for line in (t.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses(alone) == pytest.approx(losses(dp), rel=1e-5)
    blocking = train(tmp_path, "blocking", method="diloco", workers=1, inner_steps=3, **{**OVERLAP, **INNER})
    assert losses(blocking)[3:] != pytest.approx(losses(dp)[3:], rel=1e-3)  # the outer steps matter


def test_overlap_lands_the_merged_update_after_tau_steps(tmp_path):
    """τ steps from a worker's own weights, then (1 − α)·θ + α·θ_r: with α = 0 the worker's
    first τ steps of a round move only its optimizer state, so any τ gives another run than
    no overlap, and α changes it again; the last synchronisation still reaches θ."""
    runs = {name: train(tmp_path, name, method="isoloco", workers=2, inner_steps=3, steps=9,
                        **{"outer.overlap_steps": tau, "outer.overlap_alpha": alpha})
            for name, tau, alpha in (("none", 0, 0.0), ("tau1", 1, 0.0), ("tau2", 2, 0.0), ("tau1-half", 1, 0.5))}
    finals = {name: run.global_params[0] for name, run in runs.items()}
    for a, b in (("none", "tau1"), ("tau1", "tau2"), ("tau1", "tau1-half")):
        assert not torch.equal(finals[a], finals[b]), (a, b)
    again = train(tmp_path, "again", method="isoloco", workers=2, inner_steps=3, steps=9,
                  **{"outer.overlap_steps": 1, "outer.overlap_alpha": 0.5})
    assert all(torch.equal(x, y) for x, y in zip(again.global_params, runs["tau1-half"].global_params))
    lines = [json.loads(line) for line in (runs["tau1"].out_dir / "metrics.jsonl").read_text().splitlines()]
    synced = [line for line in lines if "sync_s" in line]
    # Round 0's synchronisation lands in round 1; the last one blocks at the end of round 2.
    assert [line["sync_s"] > 0 for line in synced] == [False, True, True]
    assert all(line["sync_exposed_s"] <= line["sync_s"] + 1e-3 for line in synced)


#: Plain SGD at a constant rate inside and FedAvg outside: a round's result is easy to write by hand.
PLAIN_SGD = {"inner.optimizer": "sgd", "inner.lr": 0.2, "inner.grad_clip": 0.0, "inner.warmup_fraction": 0.0,
             "inner.min_lr_ratio": 1.0, "outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0}


def overlap_by_hand(tmp_path: Path, tau: int, alpha: float, rounds: int = 3, inner_steps: int = 3) -> list[torch.Tensor]:
    """θ at the end of one worker's run with overlap τ, α, written as a plain loop over the
    same model and batches: each round after the first starts from the worker's own weights,
    and before its step τ they become (1 − α)·θ + α·w; θ ← θ − (θ − w) after every round."""
    steps = rounds * inner_steps
    inner_sgd = {key: value for key, value in PLAIN_SGD.items() if key.startswith("inner.")}  # dp has no outer step
    cfg = resolve(None, {**SMALL, "method": "dp", "steps": steps, "eval_every": steps, **inner_sgd})
    model = Trainer(cfg, tmp_path / "by-hand", progress=False)
    w = model.params
    theta = [p.detach().clone() for p in w]
    for step in range(steps):
        taken = step % inner_steps
        with torch.no_grad():
            if step >= inner_steps and taken == tau:
                for p, global_p in zip(w, theta):
                    p.copy_((1 - alpha) * global_p + alpha * p)
        model._forward_backward(model.batches.rows(step, 0, cfg.global_batch))
        with torch.no_grad():
            for p in w:
                p.sub_(0.2 * p.grad)
                p.grad = None
        if taken == inner_steps - 1:
            theta = [global_p - (global_p - p.detach()) for global_p, p in zip(theta, w)]
    return theta


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_overlap_lands_where_a_plain_loop_says(tmp_path, alpha):
    """The oracle: one worker, SGD inside and out, lr 1 outside; the landed θ matches the loop
    written by hand, and a loop that lands one step late does not."""
    tau = 1
    run = train(tmp_path, f"run-{alpha}", method="diloco", workers=1, inner_steps=3, steps=9, eval_every=9,
                **{**PLAIN_SGD, "outer.overlap_steps": tau, "outer.overlap_alpha": alpha})
    assert_close_relative(run.global_params, overlap_by_hand(tmp_path, tau, alpha), 1e-5)
    if alpha < 1:  # α = 1 lands nothing: there is no step to be late for
        late = overlap_by_hand(tmp_path, tau + 1, alpha)
        errors = [(torch.linalg.norm(x - y) / torch.linalg.norm(y)).item() for x, y in zip(run.global_params, late)]
        assert max(errors) > 1e-3


def stages_failing_at(failing: int, stages: int, ran: list[int]) -> Sync:
    """A synchronisation of `stages` stages that records each stage it runs and raises in stage `failing`."""

    def steps():
        for stage in range(stages):
            ran.append(stage)
            if stage == failing:
                raise FloatingPointError(f"overflow in stage {stage}")
            yield []

    return Sync(steps(), stages)


def test_a_stage_that_raises_raises_from_the_inner_step_that_runs_it():
    """τ = 4, 3 stages: stage 1 runs before inner step ⌈4/3⌉ = 2. Its error comes out of that
    step, not out of the landing at step 4: the rank must not train on (and post gradient
    all-reduces) while its peers post the stage's collectives. Nothing stays in flight."""
    ran: list[int] = []
    in_flight = InFlight([torch.zeros(2)], [torch.ones(2)], torch.device("cpu"), window=4)
    in_flight.start(stages_failing_at(1, 3, ran))
    in_flight.before_step(1)
    assert ran == [0] and in_flight.running
    with pytest.raises(FloatingPointError, match="overflow in stage 1"):
        in_flight.before_step(2)
    assert ran == [0, 1] and not in_flight.running
    in_flight.before_step(3)
    assert not in_flight.land() and ran == [0, 1]
    with pytest.raises(FloatingPointError, match="overflow in stage 0"):
        in_flight.start(stages_failing_at(0, 3, ran))  # the first stage runs in `start`
    assert not in_flight.running


def test_an_error_in_flight_surfaces_in_the_next_turn_and_closes_the_synchronisation(tmp_path, monkeypatch):
    """A stage that raises stops the worker's turn that runs it, and nothing of the
    synchronisation stays in flight."""
    from isoloco import outer as outer_module

    cfg = resolve(None, {**SMALL, "method": "isoloco", "workers": 2, "inner_steps": 3, "steps": 9,
                         "outer.overlap_steps": 2})
    trainer = Trainer(cfg, tmp_path / "failing", progress=False)
    (tmp_path / "failing").mkdir()
    calls = []

    def failing_step(self, *args, **kwargs):
        calls.append("step")
        raise RuntimeError("spoiled outer step")

    trainer.train_round(0, 3)  # round 0's synchronisation starts in flight
    monkeypatch.setattr(outer_module.OuterStep, "_apply", lambda self, merge, deltas, fetch: (
        (yield from merge), failing_step(self))[1])
    trainer.train_round(3, 6)  # starts and lands round 0's (fine), ends with round 1's, which will fail
    trainer.algorithm.start_pending()  # as round 2 begins
    in_flight = trainer.algorithm.in_flight
    assert in_flight.running
    with pytest.raises(RuntimeError, match="spoiled outer step"):
        trainer.take_turn(trainer.workers[0], 6, 9)
    assert calls == ["step"] and not in_flight.running


@pytest.mark.parametrize("overrides, words", [
    ({"outer.overlap_steps": 3}, "outer.overlap_steps=3 is not allowed with inner_steps=3"),
    ({"outer.overlap_steps": -1}, "outer.overlap_steps=-1 is not allowed"),
    ({"outer.overlap_alpha": 1.5}, "outer.overlap_alpha=1.5"),
    ({"outer.overlap_steps": 1, "on_bad_worker": "drop"}, "on_bad_worker=drop is not allowed with outer.overlap"),
])
def test_bad_overlap_settings_are_refused_before_training(overrides, words):
    from isoloco.errors import ConfigError

    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        resolve(None, {**SMALL, "method": "diloco", "workers": 2, "inner_steps": 3, **overrides})


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_to_a_finite_loss(tmp_path, method):
    workers = 1 if METHODS[method]["algorithm"] == "dp" else 2  # dp trains one model and refuses more
    trainer = train(tmp_path, method, method=method, workers=workers, inner_steps=3, steps=6)
    assert trainer.last_val_loss is not None and torch.isfinite(torch.tensor(trainer.last_val_loss))
    lines = (tmp_path / method / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 7))


@pytest.mark.slow
def test_offloaded_workers_give_identical_numbers(tmp_path):
    plain = train(tmp_path, "plain", method="isoloco", workers=2, inner_steps=3)
    offloaded = train(tmp_path, "offloaded", method="isoloco", workers=2, inner_steps=3, offload_workers=True)
    for a, b in zip(plain.global_params, offloaded.global_params, strict=True):
        assert torch.equal(a, b)


def test_micro_batches_accumulate_to_the_full_batch_gradient(tmp_path):
    whole = train(tmp_path, "whole", method="diloco", workers=2, inner_steps=2, **SGD)
    split = train(tmp_path, "split", method="diloco", workers=2, inner_steps=2, micro_batch=2, **SGD)
    assert_close_relative(split.global_params, whole.global_params, 1e-5)


def test_same_seed_same_bits(tmp_path):
    a = train(tmp_path, "a", method="dare", workers=2, inner_steps=2, steps=4)
    b = train(tmp_path, "b", method="dare", workers=2, inner_steps=2, steps=4)
    for x, y in zip(a.global_params, b.global_params, strict=True):
        assert torch.equal(x, y)


# -- killed and resumed through the command line -----------------------------------------

CLI_RUN = [*SMALL_ARGS, "steps=30", "inner_steps=5", "workers=2", "eval_every=10", "checkpoint_every=10",
           "method=isoloco"]


def final_global(run: Path) -> dict[str, torch.Tensor]:
    """θ of a run's newest checkpoint."""
    return load_file(str(sorted((run / "checkpoints").glob("step_*"))[-1] / "global.safetensors"))


def isoloco(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "isoloco", *args], capture_output=True, text=True,
                          env=ONE_THREAD_ENV, **kwargs)


@pytest.mark.multiprocess
# Error feedback without overlap is nightly: its residuals' resume is also
# tests/test_merge_compress.py's run killed twice, and with overlap the third case's.
@pytest.mark.parametrize("extra", [[], pytest.param(["merge.quantize=int4", "merge.error_feedback=true"],
                                                    marks=pytest.mark.nightly),
                                   ["merge.quantize=int4", "merge.error_feedback=true", "outer.overlap_steps=2",
                                    "outer.overlap_alpha=0.5"]],
                         ids=["plain", "int4-error-feedback", "int4-error-feedback-overlap"])
def test_killed_run_resumes_to_identical_numbers(tmp_path, extra):
    """Also with error feedback, whose residuals the workers carry from round to round, and
    with overlap, whose checkpoints hold the synchronisation the workers have yet to land."""
    run_args = [*CLI_RUN, *extra]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    # Both start at once: one thread each, so the reference takes the other core meanwhile.
    straight, proc = (subprocess.Popen([sys.executable, "-m", "isoloco", "train", *run_args, "--out", str(out),
                                        "--quiet"], stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                       env=ONE_THREAD_ENV)
                      for out, stderr in ((reference, subprocess.PIPE), (killed, subprocess.DEVNULL)))
    wait_for(lambda: (killed / "checkpoints" / "step_00000010").is_dir(), proc, "its checkpoint at step 10")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "summary.json").exists(), "the run finished before it could be killed"

    resumed = isoloco("train", "--resume", str(killed), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert straight.wait() == 0, straight.stderr.read()
    for name, tensor in final_global(reference).items():
        assert torch.equal(tensor, final_global(killed)[name]), name
    summary = lambda run: json.loads((run / "summary.json").read_text())
    assert summary(killed)["final_val_loss"] == summary(reference)["final_val_loss"]
    metrics = (killed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == list(range(1, 31))
    ref_metrics = (reference / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(a)["train_loss"] for a in metrics] == [json.loads(b)["train_loss"] for b in ref_metrics]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_prepared_local_corpora_train(tmp_path, kind):
    """`isoloco data prepare FILE --out DIR` then `isoloco train data=DIR`, through the CLI."""
    from test_data_shards import make_documents, write_corpus

    from isoloco.cli import main

    source = write_corpus(tmp_path, kind, make_documents(count=200))
    shards = tmp_path / "shards"
    assert main(["data", "prepare", str(source), "--out", str(shards), "--vocab-size", "512",
                 "--val-fraction", "0.2", "--text-field", "body", "--quiet"]) == 0
    run = tmp_path / "run"
    assert main(["train", f"data={shards}", "model=tiny", "seq_len=16", "global_batch=4", "workers=2", "steps=4",
                 "inner_steps=2", "data.val_tokens=256", "eval_batch=4", "device=cpu", "--out", str(run),
                 "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert torch.isfinite(torch.tensor(summary["final_val_loss"])) and summary["tokens"] == 4 * 4 * 16
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4


def test_export_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from isoloco.cli import main

    run = tmp_path / "run"
    assert main(["train", *CLI_RUN[:-1], "method=diloco", "steps=10", "--out", str(run), "--quiet"]) == 0
    exported = tmp_path / "hf"
    assert main(["export", str(run), str(exported)]) == 0
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    weights = final_global(run)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), weights[name]), name
    ids = tokenizer("In the beginning God created the heaven", return_tensors="pt").input_ids
    assert ids.shape[1] > 1 and int(ids.max()) < model.config.vocab_size
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_whole_rounds_stops_at_the_last_whole_round_of_the_schedule(tmp_path):
    """steps=10, H=3: nine steps in three rounds, the learning rate still scheduled over ten."""
    trainer = train(tmp_path, "whole", method="diloco", workers=2, inner_steps=3, whole_rounds=True)
    lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 10))
    assert lines[-1]["lr"] == trainer.workers[0].optimizer.lr_at(8) > trainer.workers[0].optimizer.lr_at(9)
    assert trainer.summary()["steps"] == 9 and "val_loss" in lines[-1] and trainer.summary()["cpu_time_s"] > 0
    dp = train(tmp_path, "dp", method="dp", inner_steps=3, whole_rounds=True)
    assert dp.summary()["steps"] == 10
