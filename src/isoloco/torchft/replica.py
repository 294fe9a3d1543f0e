"""One torchft replica group training isoloco's model under torchft's `DiLoCo`.

The group trains what worker `replica` of isoloco's simulator trains: the same model and
initial weights (from the seed), the same inner optimizer and schedule, and worker
`replica`'s share of each step's global batch. torchft does the rest: every `inner_steps`
steps its `DiLoCo` merges the pseudo-gradients over the quorum of live groups (torchft's
all-reduce of the mean, or isoloco's rule through `isoloco.torchft.quorum`) and steps the
isoloco outer optimizer (`isoloco.torchft.optimizer`); a group that (re)joins
behind the others first recovers the model, inner optimizer and outer state from a live peer.

Addresses are options, 127.0.0.1 by default (one machine): the lighthouse's (`bind`), and
each group's `host`, where its rendezvous store and torchft's manager are reached by the other
groups. torchft binds its manager server and its checkpoint HTTP server on every interface
itself; the checkpoint server, which a recovering group fetches the state from, is advertised at
`host` too (`CheckpointServer`), where torchft would name the machine's host name, which another
machine or a network namespace may not resolve to it.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
from safetensors.torch import load_file, save_file

from isoloco.train_config import TrainConfig
from isoloco.data import Batches, load_token_data
from isoloco.errors import ConfigError, first_line
from isoloco.inner import InnerOptimizer, forward_backward, mixed_precision
from isoloco.model import build_model
from isoloco.torchft import internals
from isoloco.torchft.optimizer import outer_optimizers
from isoloco.torchft.quorum import merge_in_quorum, refuse_uncarried
from isoloco.trainer import resolve_device, use_deterministic_kernels

try:
    from torch.distributed import TCPStore
    from torchft.checkpointing import HTTPTransport
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
except ImportError as error:  # the extra is optional: say how to get it, in one line
    raise ImportError(f"isoloco.torchft.replica needs torchft ({error}); install it with "
                      "pip install 'isoloco[torchft]'") from None

#: One machine: every address is the loopback one.
LOCALHOST = "127.0.0.1"


class CheckpointServer(HTTPTransport):
    """torchft's checkpoint server (`HTTPTransport`, the one its Manager makes by default),
    advertised at `host` instead of the machine's host name: inside a network namespace, or on a
    machine whose name resolves to the loopback address (/etc/hosts often does), a recovering
    group would fetch the state from its own machine and fail ("Connection refused")."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self.advertised_host = host  # before torchft's __init__, which logs the address
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        served = urlsplit(super().address())
        host = f"[{self.advertised_host}]" if ":" in self.advertised_host else self.advertised_host
        return served._replace(netloc=f"{host}:{served.port}").geturl()


def start_lighthouse(min_replicas: int, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 60000,
                     bind: str = f"{LOCALHOST}:0") -> tuple[LighthouseServer, str]:
    """A torchft lighthouse listening at `bind` (HOST:PORT; port 0: a free one), and the address
    the groups connect to, http://HOST:PORT, so HOST must be reachable from every machine.

    A quorum forms once `min_replicas` groups (and more than half of the live ones) have
    joined; a group that stops heartbeating for `heartbeat_timeout_ms` is dropped from it.
    """
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"lighthouse address {bind!r} is not HOST:PORT, e.g. 10.0.0.1:29510 (port 0: a free one)")
    try:
        server = LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  heartbeat_timeout_ms=heartbeat_timeout_ms)
    except RuntimeError as error:  # the address is not this machine's, or the port is taken
        raise ConfigError(f"cannot start a lighthouse at {bind} ({first_line(error)}); name an address of this "
                          "machine and a free port (0: any)") from None
    # address() names the machine by its host name, which other machines may not resolve.
    return server, f"http://{host}:{urlsplit(server.address()).port}"


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


def check_group_config(cfg: TrainConfig, replica: int, fragments: int, sync_delay: int = 0) -> None:
    """Refuse, in one line, a config torchft's `DiLoCo` cannot run as isoloco would."""
    if cfg.algorithm != "diloco":
        raise ConfigError(f"method={cfg.method} is not DiLoCo: torchft's DiLoCo runs the DiLoCo methods only")
    refuse_uncarried(cfg)
    if not 0 <= replica < cfg.workers:
        raise ConfigError(f"replica={replica} is not allowed: choose 0 to {cfg.workers - 1} (workers={cfg.workers})")
    if cfg.train_steps % cfg.inner_steps:
        raise ConfigError(f"steps={cfg.train_steps} is not a multiple of inner_steps={cfg.inner_steps}: torchft "
                          "never synchronises a last partial round; use whole rounds")
    if cfg.inner_steps % fragments:
        raise ConfigError(f"inner_steps={cfg.inner_steps} is not a multiple of fragments={fragments}: torchft "
                          "synchronises one fragment every inner_steps/fragments steps")
    period = cfg.inner_steps // fragments
    if not 0 <= sync_delay < period:
        raise ConfigError(f"sync_delay={sync_delay} is not allowed: a fragment's all-reduce must end before the next "
                          f"fragment's starts, so choose 0 to {period - 1} (inner_steps/fragments - 1)")
    group_device(cfg, replica)


def group_device(cfg: TrainConfig, replica: int) -> torch.device:
    """Where replica group `replica` trains: `cfg.device`, with ``auto`` meaning GPU
    replica mod (GPUs on this machine) when CUDA is available, else the CPU. A device=cuda
    run on a machine without a GPU is refused in one line."""
    device = resolve_device(cfg.device)
    if cfg.device == "auto" and device.type == "cuda":
        device = torch.device("cuda", replica % torch.cuda.device_count())
    return device


def check_machine_groups(cfg: TrainConfig, groups: list[int]) -> None:
    """Refuse, in one line, replica groups on one machine that would share a GPU: NCCL puts
    each process of a communicator on a GPU of its own."""
    devices = [group_device(cfg, replica) for replica in groups]
    gpus = [device for device in devices if device.type == "cuda"]
    if len(set(gpus)) < len(gpus):
        raise ConfigError(f"replica groups {groups} would share GPUs on this machine ({torch.cuda.device_count()} "
                          f"visible), which NCCL cannot do: run at most one group per GPU here (--groups), or "
                          f"train on the CPU (device=cpu)")


def group_backend(device: torch.device) -> str:
    """The collectives a replica group makes: NCCL for a group on a GPU, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


class JointInnerStep(torch.optim.Optimizer):
    """A worker's inner optimizers (Muon and the AdamW beside it) as one torch optimizer.

    torchft's `DiLoCo` hooks one optimizer: its pre-step hook forbids reading the state (a
    recovering peer copies it), its post-step hook allows it again and synchronises. Hooked
    on one of several optimizers, the others would step outside that lock and a peer could
    read a half-written state; hooked here, the whole inner step (clipping, every optimizer,
    clearing the gradients) is inside it. `step(s)` is `InnerOptimizer.step(s)`.
    """

    def __init__(self, inner: InnerOptimizer) -> None:
        # The parameters make it a valid torch optimizer; the state lives in `inner`'s.
        super().__init__(inner.params, {})
        self.inner = inner

    @torch.no_grad()
    def step(self, step: int) -> None:  # type: ignore[override]  (the global step, not a closure)
        self.inner.step(step)


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


def run_replica_group(
    cfg: TrainConfig,
    replica: int,
    lighthouse: str,
    *,
    fragments: int = 1,
    sync_delay: int = 0,
    host: str = LOCALHOST,
    store_port: int = 0,
    init_sync: bool = False,
    timeout: timedelta = timedelta(seconds=60),
    on_step: Callable[[int, float, torch.nn.Module], None] | None = None,
) -> GroupRun:
    """Train replica group `replica` (isoloco's worker `replica` of `cfg.workers`) under torchft.

    `cfg` is an isoloco run config (any DiLoCo method, any merge rule); `lighthouse` the
    address of a running lighthouse. `sync_delay` (torchft's `fragment_sync_delay`, the
    Streaming DiLoCo paper's τ): a fragment's pseudo-gradient is taken and its merge started
    that many inner steps before its synchronisation, so torchft's all-reduce of the mean
    overlaps those steps (the other rules merge at once: see `merge_in_quorum`); torchft then
    sets the fragment to the new θ, dropping what it trained meanwhile (`fragment_update_alpha`
    0). `host`: this machine's address, where the other groups reach this group's rendezvous
    store (at `store_port`; 0: a free port) and torchft's manager. ``init_sync=False`` because
    every group builds the same initial weights from the seed; with torchft's default (True)
    the first synchronisation copies the first group's state into the others, so only its
    first round counts.
    `on_step(step, loss, model)` runs after every inner step (and after the synchronisation
    that step triggered). Returns when torchft has committed every round.
    """
    check_group_config(cfg, replica, fragments, sync_delay)
    internals.check_version()
    device = group_device(cfg, replica)
    if cfg.deterministic:
        use_deterministic_kernels()
    autocast = mixed_precision(device)  # the trainer's step: bf16 autocast on CUDA
    data = load_token_data(cfg.data, progress=False)
    batches = Batches(data.train, cfg.seq_len, cfg.global_batch, cfg.seed)
    model = build_model(cfg.model, data.vocab_size, cfg.seq_len, cfg.seed).to(device)
    inner = InnerOptimizer(list(model.named_parameters()), cfg.inner, cfg.steps)
    joint = JointInnerStep(inner)
    names = {param: name for name, param in model.named_parameters()}
    parts = model_fragments(model, fragments)
    outer = outer_optimizers([[(names[p], p) for p in part.parameters()] for part in parts], cfg.merge, cfg.outer)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dicts()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dicts(state["inner"])

    # Each group is one process, so its own store (the group's rendezvous) lives here.
    store = TCPStore(host, store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=(ProcessGroupNCCL if group_backend(device) == "nccl" else ProcessGroupGloo)(timeout=timeout),
        load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, use_async_quorum=False,  # DiLoCo needs the quorum before each sync
        replica_id=f"isoloco_{replica}", store_addr=host, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname=host, init_sync=init_sync,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        checkpoint_transport=CheckpointServer(host, timeout),
    )
    period = cfg.inner_steps // fragments  # inner steps between two fragment synchronisations
    rounds = cfg.train_steps // period
    run = GroupRun(replica, [], [], 0, {})
    losses: list[torch.Tensor] = []
    try:
        diloco = DiLoCo(manager, list(parts), joint, outer, sync_every=cfg.inner_steps,
                        fragment_sync_delay=sync_delay, backup_device=torch.device("cpu"),
                        pin_memory=device.type == "cuda")  # θ's host copy, pinned for copies from a GPU
        merge_in_quorum(diloco, model, cfg.merge, cfg.seed, replica)  # DARE, TIES, TSV, Iso-CTS: see there
        with diloco:
            local = 0
            while manager.current_step() < rounds:
                # torchft's step counts committed synchronisations: a failed one repeats its steps,
                # a recovered group continues at its peers' step.
                step = manager.current_step() * period + local
                rows = batches.worker_batch(step, replica, cfg.workers).to(device)
                loss = forward_backward(model, rows, cfg.micro_batch_size, autocast, cfg.deterministic)
                joint.step(step)
                local = (local + 1) % period
                run.steps.append(step)
                losses.append(loss)  # a device tensor: read back once, at the end
                if on_step is not None:
                    on_step(step, float(loss), model)
        run.outer_steps = manager.current_step()
        run.losses = torch.stack(losses).tolist() if losses else []
        run.params = {name: param.detach().clone() for name, param in model.named_parameters()}
    finally:
        manager.shutdown(wait=False)
    return run
