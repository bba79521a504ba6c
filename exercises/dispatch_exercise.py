"""Exercise (mixture of experts): the dispatch plan of expert parallelism.

With ``--expert_parallel ep`` the E experts of a layer are split over the ep ranks of a
block: expert e lives on rank e // (E / ep). Before the all-to-all, each rank sorts its
(token, choice) assignments by expert, so that the rows for rank 0 come first, then those
for rank 1, and so on, and tells the all-to-all how many rows go to each rank.

Given ``expert`` (A,), the expert of each of this rank's assignments, in token order, return:
- ``order`` (A,): the permutation that sorts the assignments by expert, keeping token order
  within an expert (a *stable* sort),
- ``counts`` (E,): how many assignments each expert gets (0 for an expert nobody chose),
- ``send_splits``: a list of ep ints, the rows sent to each rank (the sum of its experts' counts).
"""

import torch  # noqa: F401  (you will need it)


def dispatch_plan(expert: torch.Tensor, num_experts: int,
                  ep: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    # TODO 1: order: torch.argsort with stable=True
    # TODO 2: counts: one number per expert, zeros included (torch.bincount with minlength)
    # TODO 3: send_splits: the counts of each rank's E / ep consecutive experts, summed, as ints
    raise NotImplementedError("exercise: write dispatch_plan()")
