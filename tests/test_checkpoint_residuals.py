"""Error feedback's residuals are an island's: a process that holds several workers keeps one
per parameter, with its island's first worker (SparseLoCo keeps an accumulator per worker), and
a checkpoint written when every worker held one still resumes to the same numbers."""

import shutil
from pathlib import Path

import pytest
import torch

from isoloco import checkpoint as ckpt
from isoloco.config import resolve
from isoloco.distributed import Distributed, process_group
from isoloco.errors import CheckpointError
from isoloco.trainer import Trainer

from helpers import final_params
from test_distributed import SMALL, _join_job, run_processes

pytestmark = pytest.mark.multiprocess

#: Two islands (processes) of two workers each.
RUN = {**SMALL, "method": "diloco", "workers": 4, "merge.quantize": "int8", "merge.error_feedback": True,
       "checkpoint_every": 3, "dist.timeout_s": 60}


def _old_format(checkpoint: Path, islands: int, workers: int) -> None:
    """Rewrite `checkpoint`'s worker files as they were written before: a zero residual for every
    worker that is not its island's first, with the checksums to match."""
    state = ckpt.verify(checkpoint)
    per_island = workers // islands
    for island in range(islands):
        stem = ckpt.workers_file(island)
        tensors = ckpt.load_tensors(checkpoint, stem)
        head = island * per_island
        kept = {key[len(f"w{head}."):]: tensor for key, tensor in tensors.items()
                if key.startswith(f"w{head}.residual.")}
        assert kept, "the island's first worker keeps its residuals"
        for worker in range(head + 1, head + per_island):
            assert not any(key.startswith(f"w{worker}.residual.") for key in tensors)
            tensors.update({f"w{worker}.{key}": torch.zeros_like(tensor) for key, tensor in kept.items()})
        state["checksums"].update(ckpt.write_tensor_file(checkpoint, stem, tensors))
    ckpt.write_json_atomic(checkpoint / ckpt.STATE_FILE, state)


def _residual_runs(rank: int, world_size: int, port: int, root: str) -> None:
    _join_job(rank, world_size, port)
    root = Path(root)
    cfg = resolve(None, RUN)
    with process_group(cfg):
        straight, resumed = root / "straight", root / "resumed"
        straight.mkdir(exist_ok=True)
        trainer = Trainer(cfg, straight, progress=False)
        counts = {"feedback": [len(w.residual) for w in trainer.algorithm.workers],
                  "params": len(trainer.named_params)}
        trainer.run()
        sparse = Trainer(resolve(None, {**RUN, "merge.quantize": "none", "merge.error_feedback": False,
                                        "outer.transport": "sparseloco"}), root / f"sparse{rank}", progress=False)
        counts["sparseloco"] = [len(w.residual) for w in sparse.algorithm.workers]
        torch.save(counts, root / f"counts.{rank}.pt")
        if rank == 0:
            shutil.copytree(straight, resumed)
            shutil.rmtree(resumed / "checkpoints" / "step_00000006")
            _old_format(resumed / "checkpoints" / "step_00000003", world_size, RUN["workers"])
        Distributed(cfg).barrier()
        again = Trainer(cfg, resumed, progress=False)
        again.run(resume=True)
        # A nonzero residual of a worker whose residual is never read is state the run would lose.
        checkpoint = resumed / "checkpoints" / "step_00000003"
        stem, worker = ckpt.workers_file(rank), 2 * rank + 1
        key = f"w{worker}.residual.{again.named_params[0][0]}"

        def load(file: str) -> dict[str, torch.Tensor]:
            tensors = ckpt.load_tensors(checkpoint, file)
            if file == stem:
                tensors[key] = torch.ones_like(tensors[key])
            return tensors

        with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
            again.algorithm.load_checkpoint_files(load)


@pytest.fixture(scope="module")
def residual_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("residuals")
    run_processes(_residual_runs, 2, str(root))
    return root


def test_a_process_of_several_workers_keeps_one_residual_per_island(residual_runs):
    for rank in range(2):
        counts = torch.load(residual_runs / f"counts.{rank}.pt")
        assert counts["feedback"] == [counts["params"], 0], rank  # its island's first worker's, once
        assert counts["sparseloco"] == [counts["params"]] * 2, rank  # an accumulator per worker


def test_a_checkpoint_with_every_workers_residual_resumes_to_the_same_numbers(residual_runs):
    straight, resumed = (final_params(residual_runs / name) for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
