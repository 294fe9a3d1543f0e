"""Named methods: the paper's released configurations (docs/fidelity.md) as overrides of the run config.

A method is only a set of default values; every one of them can be overridden with
`key=value`. Inner learning rates are the paper's for the 178M model.
"""

from __future__ import annotations

from typing import Any

_ISO_FAST = {"merge.ortho": "newton_schulz", "merge.scale": "rms"}
# SparseLoCo as tplr-ai/templar deploys it: error feedback with decay in momentum's place, SGD at lr 1
# (docs/fidelity.md); DiLoCo's inner lr, since its own is for other models.
_SPARSELOCO = {"outer.transport": "sparseloco", "outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0,
               "inner.lr": 0.00138}

METHODS: dict[str, dict[str, Any]] = {
    # The reference's data-parallel baseline clips no gradients (only DiLoCo's inner steps clip).
    "dp": {"algorithm": "dp", "inner.lr": 0.00195, "inner.weight_decay": 0.15, "inner.grad_clip": 0.0},
    "diloco": {"merge.rule": "mean", "outer.optimizer": "nesterov", "outer.lr": 0.7, "outer.momentum": 0.9,
               "inner.lr": 0.00138},
    "diloco_sgd": {"merge.rule": "mean", "outer.optimizer": "sgd", "outer.lr": 1.6, "outer.momentum": 0.0,
                   "inner.lr": 0.00138},
    "isoc": {"merge.rule": "iso_c", "outer.optimizer": "sgd", "outer.lr": 2.1, "outer.momentum": 0.0,
             "inner.lr": 0.00391},
    "isoloco": {"merge.rule": "iso_c", "outer.optimizer": "nesterov", "outer.lr": 1.8, "outer.momentum": 0.8,
                "inner.lr": 0.00138},
    "isoloco_fast": {"merge.rule": "iso_c", **_ISO_FAST, "outer.optimizer": "nesterov", "outer.lr": 1.8,
                     "outer.momentum": 0.8, "inner.lr": 0.00138},
    "ties": {"merge.rule": "ties", "merge.density": 0.9, "outer.optimizer": "sgd", "outer.lr": 0.7,
             "outer.momentum": 0.0, "inner.lr": 0.00276},
    "dare": {"merge.rule": "dare", "merge.drop_rate": 0.1, "outer.optimizer": "sgd", "outer.lr": 1.5,
             "outer.momentum": 0.0, "inner.lr": 0.00276},
    "tsv": {"merge.rule": "tsv", "outer.optimizer": "sgd", "outer.lr": 0.6, "outer.momentum": 0.0,
            "inner.lr": 0.00276},
    "isocts": {"merge.rule": "iso_cts", "merge.common_fraction": 0.8, "outer.optimizer": "sgd", "outer.lr": 3.1,
               "outer.momentum": 0.0, "inner.lr": 0.00391},
    "muloco": {"inner.optimizer": "muon", "merge.rule": "mean", "outer.optimizer": "nesterov", "outer.lr": 0.7,
               "outer.momentum": 0.6, "inner.lr": 0.00138},
    "isoloco_muon": {"inner.optimizer": "muon", "merge.rule": "iso_c", "outer.optimizer": "nesterov",
                     "outer.lr": 1.8, "outer.momentum": 0.8, "inner.lr": 0.00138},
    "sparseloco": {"merge.rule": "mean", **_SPARSELOCO},
    # Its error feedback as momentum, with Iso-C on the mean it sends, and no Nesterov.
    "sparseloco_isoc": {"merge.rule": "iso_c", **_SPARSELOCO},
}

for _values in METHODS.values():
    _values.setdefault("algorithm", "diloco")
