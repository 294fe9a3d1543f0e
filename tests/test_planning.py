"""The planning model's arithmetic and its command line (nothing is measured here)."""

import pytest

from isoloco.bench import planning

GPU = planning.Scenario("178m", islands=8, gpus_per_worker=8, inner_steps=30, tokens_per_step=256 * 2048,
                        tokens_per_s=150_000, fast=planning.Link(300e9, 10e-6), slow_latency=0.02)


def test_rings_move_their_textbook_bytes():
    link = planning.Link(bandwidth=100.0, latency=0.5)
    assert link.seconds("all_reduce", 400, 4, 1) == pytest.approx(2 * 3 * (1 + 0.5))
    assert link.seconds("all_gather", 400, 4, 2) == pytest.approx(3 * (1 + 2 * 0.5))
    assert link.seconds("all_reduce", 400, 1, 3) == 0  # alone: nothing to send


def test_the_split_sends_one_island_copy_and_diloco_beats_dp_on_a_slow_link():
    slow = 1e9 / 8  # 1 Gbit/s
    times = GPU.round_seconds(slow)
    compute_and_fast = times["compute"] + GPU.inner_steps * GPU.fast.seconds("all_reduce", GPU.model_bytes, 8, 1)
    ring = 2 * 7 / 8 * GPU.model_bytes / slow
    latency = 2 * 7 * GPU.merge_collectives * GPU.slow_latency
    assert times["diloco, G copies across"] - compute_and_fast == pytest.approx(8 * ring + latency)
    gather = GPU.fast.seconds("all_gather", GPU.model_bytes, 8, GPU.merge_collectives)
    assert times["diloco, split"] - compute_and_fast == pytest.approx(ring + latency + gather)
    assert times["compute"] < times["diloco, split"] < times["diloco, G copies across"] < times["dp"]
    # With an unlimited slow link only its latency is left: DP pays one chain across islands per
    # step (its gradient buckets overlap), the merge one per bucket, once per round.
    latency_only = GPU.round_seconds(1e30)
    assert latency_only["dp"] == pytest.approx(compute_and_fast + GPU.inner_steps * 14 * GPU.slow_latency)
    assert latency_only["diloco, split"] == pytest.approx(compute_and_fast + latency + gather)


@pytest.mark.slow
def test_the_command_prints_a_table_and_draws_the_plot(tmp_path, capsys):
    png = tmp_path / "round.png"
    assert planning.main(["--preset", "178m", "--workers", "8", "--gpus-per-worker", "8", "--global-batch", "256",
                          "--seq-len", "2048", "--tokens-per-s", "150000", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| 1 Gbit/s |" in out and "150,000 tokens/s per process (given)" in out
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("argv, words", [
    (["--workers", "0"], "must be > 0"),
    (["--preset", "huge"], "not a model preset"),
    (["--global-batch", "6", "--workers", "4"], "does not split evenly"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as stopped:
        planning.main([*argv, "--tokens-per-s", "1000"])
    assert stopped.value.code == 2
    assert words in capsys.readouterr().err
