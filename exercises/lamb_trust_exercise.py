"""Exercise (large batches): LAMB's step for one tensor, with its trust ratio.

Adam moves every element by about ``lr`` whatever the size of the weights, so the learning rate
that a large batch needs is too large for some layers. LAMB keeps Adam's direction but scales
each tensor's step by a trust ratio, so that the step is ``lr`` times the tensor's own norm:

    u     = direction + weight_decay * w     (direction: Adam's m_hat / (sqrt(v_hat) + eps))
    trust = ||w|| / ||u||                     (1 when either norm is 0: a fresh zero tensor moves)
    w_new = w - lr * trust * u

Write ``lamb_update`` for one whole tensor (distributed/lamb.py does the same for every tensor
at once, with the norms summed over ranks when a tensor is split).
"""

import torch  # noqa: F401  (you will need it)


def lamb_update(weight: torch.Tensor, direction: torch.Tensor, lr: float,
                weight_decay: float) -> torch.Tensor:
    """The tensor after one LAMB step (a new tensor; ``weight`` is not changed)."""
    # TODO 1: u = Adam's direction plus the weight decay term
    # TODO 2: the trust ratio ||w|| / ||u|| (torch's .norm()), or 1 when either norm is 0
    # TODO 3: return the weight moved by lr * trust along -u
    raise NotImplementedError("exercise: write lamb_update()")
