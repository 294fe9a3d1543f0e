"""What a run directory and a sweep directory hold: the file names every command agrees on.

`isoloco train` writes a run directory, `--resume`, `export`, `sweep` and `report` read it;
keeping the names here means a renamed file cannot leave one of them looking elsewhere.
"""

#: The fully resolved config of the run (YAML); its presence makes a folder a run directory.
CONFIG_FILE = "config.yaml"
#: One JSON line per step: losses, lr, timing; validation loss and bytes at synchronisations.
METRICS_FILE = "metrics.jsonl"
#: Written when the run has finished: final validation loss, tokens, wall and CPU time.
SUMMARY_FILE = "summary.json"
#: The tokenizer the run trained with, so `export` can ship it beside the model.
TOKENIZER_FILE = "tokenizer.json"
#: Checkpoint directories `step_XXXXXXXX/`.
CHECKPOINT_DIR = "checkpoints"
#: TensorBoard event files (`log.tensorboard=true`).
TENSORBOARD_DIR = "tensorboard"
#: In a sweep directory: the last sweep's grid and overrides.
SWEEP_MANIFEST = "sweep.yaml"
