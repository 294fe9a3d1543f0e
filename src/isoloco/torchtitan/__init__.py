"""IsoLoCo in torchtitan: isoloco's outer step inside torchtitan's fault-tolerant DiLoCo trainer.

torchtitan (FSDP / tensor parallelism inside a replica group) with torchft (fault-tolerant
DiLoCo across groups) is a recipe for training across machines; ``pip install
'isoloco[torchtitan]'`` gives it isoloco's outer step. Launch with torchtitan's own flags and
``--module isoloco.torchtitan --config llama3_isoloco_debugmodel`` (or ``llama3_isoloco_178m``),
through ``python -m isoloco.torchtitan``, which reports a refused setting in one line:

* `settings` (no torchtitan import): `OuterSettings`, the ``--isoloco.*`` flags, as isoloco's
  merge and outer configs;
* `sharded` (no torchtitan import): Iso-C of matrices sharded inside a group (DTensors), on the
  whole matrix;
* `diloco`: the binding that builds torchft's `DiLoCo` with isoloco's outer optimizers, in
  place of torchtitan's fixed SGD / Nesterov;
* `trainer`: `IsoLoCoTrainer`, torchtitan's torchft trainer with that binding and the checks
  run before torchft starts;
* `config_registry`: the ``--config`` entries; `internals`: torchtitan's non-public names used.
"""
