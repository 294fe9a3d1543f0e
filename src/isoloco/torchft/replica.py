"""One torchft replica group training isoloco's model under torchft's `DiLoCo`.

The group trains what worker `replica` of isoloco's simulator trains: the same model and
initial weights (from the seed), the same inner optimizer and schedule, and worker
`replica`'s share of each step's global batch. torchft does the rest: every `inner_steps`
steps its `DiLoCo` all-reduces the mean pseudo-gradient over the quorum of live groups and
steps the isoloco outer optimizer (`isoloco.torchft.optimizer`); a group that (re)joins
behind the others first recovers the model, inner optimizer and outer state from a live peer.

Everything listens on 127.0.0.1 except what torchft binds itself: its manager server and
its checkpoint HTTP server bind every interface (the latter advertises the host name).
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from isoloco.config import TrainConfig
from isoloco.data import Batches, load_token_data
from isoloco.errors import ConfigError
from isoloco.inner import InnerOptimizer
from isoloco.model import build_model
from isoloco.torchft.optimizer import outer_optimizers

try:
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
except ImportError as error:  # the extra is optional: say how to get it, in one line
    raise ImportError(f"isoloco.torchft.replica needs torchft ({error}); install it with "
                      "pip install 'isoloco[torchft]'") from None

HOST = "127.0.0.1"


def start_lighthouse(min_replicas: int, heartbeat_timeout_ms: int = 5000,
                     join_timeout_ms: int = 60000) -> tuple[LighthouseServer, str]:
    """A torchft lighthouse on 127.0.0.1 at a free port, and the address groups connect to.

    A quorum forms once `min_replicas` groups (and more than half of the live ones) have
    joined; a group that stops heartbeating for `heartbeat_timeout_ms` is dropped from it.
    """
    server = LighthouseServer(bind=f"{HOST}:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    # address() names the host by its host name; the port is what matters on 127.0.0.1.
    return server, f"http://{HOST}:{urlsplit(server.address()).port}"


def model_fragments(model: torch.nn.Module, count: int) -> list[torch.nn.ModuleList]:
    """`count` Streaming DiLoCo fragments of isoloco's Llama: contiguous blocks of decoder
    layers, the embeddings with the first and the final norm and LM head with the last, so
    every parameter is synchronised by exactly one fragment."""
    layers = list(model.model.layers)
    if not 1 <= count <= len(layers):
        raise ConfigError(f"fragments={count} is not allowed: choose 1 to {len(layers)} (the model's layers)")
    blocks = [layers[len(layers) * i // count:len(layers) * (i + 1) // count] for i in range(count)]
    blocks[0] = [model.model.embed_tokens, *blocks[0]]
    blocks[-1] = [*blocks[-1], model.model.norm, model.lm_head]
    return [torch.nn.ModuleList(block) for block in blocks]


def check_group_config(cfg: TrainConfig, replica: int, fragments: int) -> None:
    """Refuse, in one line, a config torchft's `DiLoCo` cannot run as isoloco would."""
    if cfg.algorithm != "diloco":
        raise ConfigError(f"method={cfg.method} is not DiLoCo: torchft's DiLoCo runs the DiLoCo methods only")
    if not 0 <= replica < cfg.workers:
        raise ConfigError(f"replica={replica} is not allowed: choose 0 to {cfg.workers - 1} (workers={cfg.workers})")
    if cfg.train_steps % cfg.inner_steps:
        raise ConfigError(f"steps={cfg.train_steps} is not a multiple of inner_steps={cfg.inner_steps}: torchft "
                          "never synchronises a last partial round; use whole rounds")
    if cfg.inner_steps % fragments:
        raise ConfigError(f"inner_steps={cfg.inner_steps} is not a multiple of fragments={fragments}: torchft "
                          "synchronises one fragment every inner_steps/fragments steps")
    if cfg.device not in ("cpu", "auto"):
        raise ConfigError(f"device={cfg.device} is not supported here: replica groups run on CPU with gloo")


@dataclasses.dataclass
class GroupRun:
    """What one replica group did: every inner step it trained, in order, and where it ended."""

    replica: int
    steps: list[int]  # the global inner step of each inner step trained (a retried round repeats)
    losses: list[float]  # the training loss of each of those steps
    outer_steps: int  # outer steps torchft committed (its manager's step)
    params: dict[str, torch.Tensor]  # θ after the last synchronisation

    def save(self, path: Path) -> None:
        """Write the run as `path`.json and `path`.safetensors (for a parent process to read)."""
        save_file(self.params, path.with_suffix(".safetensors"))
        record = {"replica": self.replica, "steps": self.steps, "losses": self.losses, "outer_steps": self.outer_steps}
        path.with_suffix(".json").write_text(json.dumps(record))

    @classmethod
    def load(cls, path: Path) -> GroupRun:
        """Read a run written by `save`."""
        return cls(**json.loads(path.with_suffix(".json").read_text()), params=load_file(path.with_suffix(".safetensors")))


def _loss(model: torch.nn.Module, rows: torch.Tensor, micro_batch: int) -> float:
    """Mean next-token loss of `rows`, accumulated over micro-batches as isoloco's trainer does."""
    chunks = rows.split(micro_batch)
    total = 0.0
    for chunk in chunks:
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))
        (loss / len(chunks)).backward()
        total += loss.item()
    return total / len(chunks)


def run_replica_group(
    cfg: TrainConfig,
    replica: int,
    lighthouse: str,
    *,
    fragments: int = 1,
    init_sync: bool = False,
    timeout: timedelta = timedelta(seconds=60),
    on_step: Callable[[int, float, torch.nn.Module], None] | None = None,
) -> GroupRun:
    """Train replica group `replica` (isoloco's worker `replica` of `cfg.workers`) under torchft.

    `cfg` is an isoloco run config (a DiLoCo method whose rule fits torchft: see `RULE_FIT`);
    `lighthouse` the address of a running lighthouse. ``init_sync=False`` because every group
    builds the same initial weights from the seed; with torchft's default (True) the first
    synchronisation copies the first group's state into the others, so only its first round
    counts. `on_step(step, loss, model)` runs after every inner step (and after the
    synchronisation that step triggered). Returns when torchft has committed every round.
    """
    check_group_config(cfg, replica, fragments)
    data = load_token_data(cfg.data, progress=False)
    batches = Batches(data.train, cfg.seq_len, cfg.global_batch, cfg.seed)
    model = build_model(cfg.model, data.vocab_size, cfg.seq_len, cfg.seed)
    inner = InnerOptimizer(list(model.named_parameters()), cfg.inner, cfg.steps)
    names = {param: name for name, param in model.named_parameters()}
    parts = model_fragments(model, fragments)
    outer = outer_optimizers([[(names[p], p) for p in part.parameters()] for part in parts], cfg.merge, cfg.outer)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dicts()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dicts(state["inner"])

    # Each group is one process, so its own store (the group's rendezvous) lives here.
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, use_async_quorum=False,  # DiLoCo needs the quorum before each sync
        replica_id=f"isoloco_{replica}", store_addr=HOST, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname=HOST, init_sync=init_sync,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
    )
    period = cfg.inner_steps // fragments  # inner steps between two fragment synchronisations
    rounds = cfg.train_steps // period
    run = GroupRun(replica, [], [], 0, {})
    try:
        # torchft hooks the inner optimizer stepped last, so it syncs after every one has stepped.
        with DiLoCo(manager, list(parts), inner.optimizers[-1], outer, sync_every=cfg.inner_steps,
                    backup_device=torch.device("cpu"), pin_memory=False):
            local = 0
            while manager.current_step() < rounds:
                # torchft's step counts committed synchronisations: a failed one repeats its steps,
                # a recovered group continues at its peers' step.
                step = manager.current_step() * period + local
                loss = _loss(model, batches.worker_batch(step, replica, cfg.workers), cfg.micro_batch_size)
                inner.step(step)
                local = (local + 1) % period
                run.steps.append(step)
                run.losses.append(loss)
                if on_step is not None:
                    on_step(step, loss, model)
        run.outer_steps = manager.current_step()
        run.params = {name: param.detach().clone() for name, param in model.named_parameters()}
    finally:
        manager.shutdown(wait=False)
    return run
