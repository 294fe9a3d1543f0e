"""IsoLoCo inside torchft: isoloco's outer step as the outer optimizer of torchft's `DiLoCo`.

torchft (`pip install 'isoloco[torchft]'`) keeps a quorum of replica groups through its
lighthouse, recovers a restarted group from a live peer and all-reduces the mean of the
groups' pseudo-gradients into ``p.grad`` before stepping its outer optimizer. Every isoloco
rule that is a function of that mean runs there unchanged:

* `optimizer` (no torchft import): which rules fit the mean, and the outer optimizer per
  model fragment that reproduces isoloco's own outer step from it;
* `replica` (needs torchft): one replica group training isoloco's model on isoloco's
  batches under torchft's `DiLoCo`, and a lighthouse on 127.0.0.1 for one-machine runs.
"""

from isoloco.torchft.optimizer import RULE_FIT, outer_optimizer, outer_optimizers

__all__ = ["RULE_FIT", "outer_optimizer", "outer_optimizers"]
