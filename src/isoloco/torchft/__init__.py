"""IsoLoCo inside torchft: isoloco's outer step, and every merge rule, in torchft's `DiLoCo`.

torchft (`pip install 'isoloco[torchft]'`) keeps a quorum of replica groups through its
lighthouse, recovers a restarted group from a live peer and all-reduces the mean of the
groups' pseudo-gradients into ``p.grad`` before stepping its outer optimizer:

* `optimizer` (no torchft import): the outer optimizer per model fragment that reproduces
  isoloco's own outer step; mean and Iso-C step on torchft's mean;
* `quorum` (no torchft import): every other rule (DARE, TIES, TSV, Iso-CTS) merged by
  isoloco's merge engine over torchft's quorum, in place of the mean (`merge_in_quorum`);
* `replica` (needs torchft): one replica group training isoloco's model on isoloco's
  batches under torchft's `DiLoCo`, its inner optimizers stepping as one inside torchft's
  hooks, and a lighthouse; addresses default to 127.0.0.1 and are options for several machines.
"""

from isoloco.torchft.optimizer import MEAN_RULES, merges_in_quorum, outer_optimizer, outer_optimizers
from isoloco.torchft.quorum import QuorumCommunicator, merge_in_quorum

__all__ = ["MEAN_RULES", "QuorumCommunicator", "merge_in_quorum", "merges_in_quorum", "outer_optimizer",
           "outer_optimizers"]
