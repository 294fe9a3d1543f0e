"""torchtitan ``--config`` entries of the recipe (``--module isoloco.torchtitan``).

Each is torchtitan's own torchft Llama 3 debug config (`llama3_torchft_debugmodel`: torchft on,
semi-sync DiLoCo, its batch, schedule and checkpoints) turned into an `IsoLoCoTrainer.Config`,
with IsoLoCo's outer step (the ``--isoloco.*`` defaults) and profiling off:

* `llama3_isoloco_debugmodel`: torchtitan's 6.2M-parameter Llama 3 debug model;
* `llama3_isoloco_178m`: a Llama 3 of the shape of isoloco's ``paper-178m`` preset (hidden 1024,
  9 layers of 8 heads, FFN 2688, a 32,000-token vocabulary, untied embeddings), its H = 30, 225
  rounds and IsoLoCo's inner learning rate, on C4; give it the tokenizer of that vocabulary with
  ``--hf-assets-path``.

Every value is a flag; e.g. ``--fault_tolerance.sync_steps 20 --isoloco.fast``.
"""

from __future__ import annotations

from dataclasses import fields, replace

from isoloco.torchtitan import internals

internals.check_version()  # first: the names imported below are torchtitan 0.3.0's

from torchtitan.experiments.torchft.config.job_config import FaultTolerantModelSpec  # noqa: E402
from torchtitan.experiments.torchft.llama3 import model_registry  # noqa: E402
from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.llama3 import Llama3Model  # noqa: E402
# Private in torchtitan 0.3.0: the initialisations and layer builder every Llama 3 shape of
# torchtitan's is made of.
from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers,  # noqa: E402
                                      _output_linear_init)
from torchtitan.tools.profiler import Profiler  # noqa: E402

from isoloco.methods import METHODS  # noqa: E402
from isoloco.model import MODEL_PRESETS  # noqa: E402
from isoloco.torchtitan.trainer import IsoLoCoTrainer  # noqa: E402

#: The paper's vocabulary (the Llama 2 tokenizer's), H and rounds at 178M (isoloco's paper-178m).
PAPER_VOCAB = 32000
PAPER_SYNC_STEPS = 30
PAPER_ROUNDS = 225


def llama3_paper_shape(name: str, attn_backend: str = "flex") -> Llama3Model.Config:
    """torchtitan's Llama 3 with the shape of isoloco's model preset `name` and the paper's vocabulary."""
    shape = MODEL_PRESETS[name]
    return Llama3Model.Config(
        dim=shape.hidden, vocab_size=PAPER_VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=PAPER_VOCAB, embedding_dim=shape.hidden,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=shape.hidden, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=shape.hidden, out_features=PAPER_VOCAB,
                              param_init=_output_linear_init(shape.hidden)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=shape.layers, dim=shape.hidden, n_heads=shape.heads, n_kv_heads=shape.kv_heads,
            hidden_dim=shape.ffn, attn_backend=attn_backend,
            rope=ComplexRoPE.Config(dim=shape.hidden // shape.heads, max_seq_len=131072, theta=500000,
                                    scaling="llama")),
    )


def model_spec(flavor: str, attn_backend: str = "flex") -> FaultTolerantModelSpec:
    """torchtitan's torchft Llama 3 spec (parallelism, fragments, checkpoints) of `flavor`: one
    of torchtitan's Llama 3 flavors, or ``178m`` (`llama3_paper_shape`)."""
    if flavor != "178m":
        return model_registry(flavor, attn_backend)
    return replace(model_registry("debugmodel", attn_backend), flavor=flavor,
                   model=llama3_paper_shape(flavor, attn_backend))


def recipe(spec: FaultTolerantModelSpec) -> IsoLoCoTrainer.Config:
    """torchtitan's torchft debug config with model `spec`, as the recipe's config."""
    base = llama3_torchft_debugmodel()
    config = IsoLoCoTrainer.Config(**{f.name: getattr(base, f.name) for f in fields(base) if f.init})
    config.model_spec = spec
    config.profiler = Profiler.Config()  # the debug config profiles every 10 steps
    return config


def llama3_isoloco_debugmodel() -> IsoLoCoTrainer.Config:
    """IsoLoCo on torchtitan's Llama 3 debug model."""
    return recipe(model_spec("debugmodel"))


def llama3_isoloco_178m() -> IsoLoCoTrainer.Config:
    """IsoLoCo on the paper's 178M shape, H = 30, C4: the paper's 225 rounds and inner AdamW
    learning rate, one validation at the end."""
    config = recipe(model_spec("178m"))
    config.fault_tolerance.sync_steps = PAPER_SYNC_STEPS
    config.fault_tolerance.num_fragments = 1
    config.training.steps = PAPER_ROUNDS * PAPER_SYNC_STEPS
    config.validator.freq = config.training.steps
    (adamw,) = config.optimizer.param_groups
    adamw.optimizer_kwargs["lr"] = METHODS["isoloco"]["inner.lr"]
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4")
    return config
