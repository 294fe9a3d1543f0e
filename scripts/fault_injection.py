"""Kill a training run with SIGKILL at random moments N times, resuming each time, then
check that it ends with exactly the numbers of a run that was never interrupted.

    python scripts/fault_injection.py [--kills 20] [--seed 0] [--workdir DIR]

Checkpoints are written every round, so kills land during training, evaluation and
checkpoint writes alike. Exit status 0 when the final summary.json's validation loss and
every final parameter are bit-identical to the uninterrupted run's, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

STEPS, INNER_STEPS = 300, 5
RUN = ["model=tiny", "method=isoloco", "workers=4", f"inner_steps={INNER_STEPS}", f"steps={STEPS}", "seq_len=32",
       "global_batch=8", "eval_every=25", f"checkpoint_every={INNER_STEPS}", "data.vocab_size=512",
       "data.val_tokens=2048", "device=cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "isoloco", "train", *args, "--quiet"]


def final_state(run: Path) -> tuple[float, dict[str, torch.Tensor]]:
    summary = json.loads((run / "summary.json").read_text())
    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    return summary["final_val_loss"], load_file(str(last / "global.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="isoloco-faults-"))
    reference, victim = work / "reference", work / "victim"
    for run in (reference, victim):  # runs of an earlier invocation must not be mistaken for these
        shutil.rmtree(run, ignore_errors=True)

    began = time.perf_counter()
    proc = subprocess.Popen(command(*RUN, "--out", str(reference), "--force"), env=ENV)
    while proc.poll() is None and not (reference / "metrics.jsonl").is_file():
        time.sleep(0.02)
    startup = time.perf_counter() - began
    if proc.wait() != 0:
        print("the uninterrupted run failed")
        return 1
    total = time.perf_counter() - began
    rounds = len(list(range(0, STEPS, INNER_STEPS)))
    round_time = (total - startup) / rounds
    print(f"uninterrupted run: {total:.1f}s ({startup:.1f}s start-up, {round_time:.2f}s per round)")

    proc = subprocess.Popen(command(*RUN, "--out", str(victim), "--force"), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kills = 0
    while kills < args.kills:
        # From the second half of start-up to about three rounds in: kills land in start-up,
        # resume, training, evaluation and checkpoint writes, and the run (60 rounds)
        # outlives 20 of them.
        delay = rng.uniform(0.5 * startup, startup + 3.0 * round_time)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            steps = sorted((victim / "checkpoints").glob("step_*"))
            print(f"kill {kills:2d} after {delay:4.1f}s; newest checkpoint: {steps[-1].name if steps else 'none'}")
            if not (victim / "config.yaml").exists():
                # Killed before the run directory was set up: start afresh, as a user would.
                proc = subprocess.Popen(command(*RUN, "--out", str(victim), "--force"), env=ENV,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                proc = subprocess.Popen(command("--resume", str(victim)), env=ENV,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            continue
        if proc.returncode != 0:
            print(f"run exited with status {proc.returncode}")
            return 1
        print(f"the run finished after {kills} kills; raise --kills or the run length for more")
        break
    if proc.wait() != 0:
        print(f"final resume exited with status {proc.returncode}")
        return 1

    ref_loss, ref_params = final_state(reference)
    loss, params = final_state(victim)
    identical = loss == ref_loss and all(torch.equal(params[k], v) for k, v in ref_params.items())
    print(f"kills: {kills}; final_val_loss uninterrupted {ref_loss!r}, killed and resumed {loss!r}")
    print("parameters and final_val_loss bit-identical" if identical else "MISMATCH")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
