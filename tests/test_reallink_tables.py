"""The real-link benchmark's tables, from saved runs (`--from-json`): no namespace needed."""

import json

from isoloco.bench import reallink
from isoloco.sync.cost import TCP_FRAMING


def run(round_s, exposed, compute, sync, kernel, reported=1_000_000.0, losses=None, peer_wait=None):
    figures = {"round_s": round_s, "sync_exposed_s": exposed, "compute_s": compute, "sync_s": sync,
               "kernel_bytes_per_sync": kernel, "reported_bytes_per_sync": reported}
    if peer_wait is not None:  # runs saved before it was recorded have none
        figures["peer_wait_s"] = peer_wait
    if losses is not None:  # nor the loss counters
        figures.update(zip(("dropped_per_sync", "retransmitted_per_sync", "timeouts_per_sync"), losses))
    return figures


def test_the_tables_set_each_measurement_beside_its_prediction(tmp_path, capsys):
    saved = {"command": "python -m isoloco.bench.reallink --rates 8", "load": 1.5,
             "setup": {"islands": 2, "processes": 1, "model": "tiny", "inner_steps": 12, "global_batch": 8,
                       "seq_len": 64},
             "cases": [{"setting": "float32", "rate_mbit": None, "tau": 0,
                        "runs": [run(3.2, 0.2, 3.0, 0.2, 1_000_000)] * 3},
                       {"setting": "float32", "rate_mbit": 8.0, "tau": 0,
                        "runs": [run(4.0, 1.0, 3.0, 1.0, 1_010_000), run(5.0, 2.0, 3.0, 2.0, 1_020_000),
                                 run(4.5, 1.5, 3.0, 1.5, 1_030_000)]},
                       {"setting": "float32", "rate_mbit": 8.0, "tau": 2,
                        "runs": [run(3.6, 0.5, 3.0, 1.6, 1_020_000, losses=(4, 6, 1), peer_wait=0.1),
                                 run(3.7, 0.5, 3.0, 1.7, 1_020_000, losses=(2, 3, 0), peer_wait=0.2),
                                 run(3.8, 0.5, 3.0, 1.8, 1_020_000, losses=(0, 1, 0), peer_wait=0.3)]}]}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(saved))
    assert reallink.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| float32 | 0 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # round (no ratio at τ = 0), exposed, beyond compute (round − compute_s): medians with their ranges
    assert cells[2:7] == ["4.50 (4.00–5.00)", "—", "1.50 (1.00–2.00)", "—", "1.50 (1.00–2.00)"]
    # the model: the unshaped run's merge compute, 0.2 s, plus 1 MB with TCP's headers at 1 MB/s
    model_sync = 0.2 + 1_000_000 * TCP_FRAMING / 1e6
    assert cells[8] == f"{model_sync:.2f}" and cells[9] == f"{(1.5 - model_sync) / model_sync:+.0%}"
    # the model's round: the unshaped compute (3.2 − 0.2) plus the model's synchronisation
    assert cells[10] == f"{3.0 + model_sync:.2f}"
    assert cells[11:] == ["1,020,000", "1,000,000", "+2.0%", "—"]  # no loss counters saved
    overlapped = next(line for line in out.splitlines() if line.startswith("| float32 | 2 |"))
    cells = [cell.strip() for cell in overlapped.strip("|").split("|")]
    # its round against τ = 0's, medians 3.7 / 4.5; the model hides 2 of 12 steps of 3.0 s compute
    assert cells[3] == f"{3.7 / 4.5:.2f}" and cells[9] == "—"
    # what a round spent beyond its compute, beside the exposed seconds and the wait for the slowest peer
    assert cells[4:7] == ["0.50 (0.50–0.50)", "0.20 (0.10–0.30)", "0.70 (0.60–0.80)"]
    assert cells[10] == f"{3.0 + model_sync - 3.0 * 2 / 12:.2f}"
    assert cells[14] == "2.0 / 3.0 / 0.0"  # medians of dropped, retransmitted, timeouts per sync
    assert "`python -m isoloco.bench.reallink --rates 8`; load average 1.50" in out
