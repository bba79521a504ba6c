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

import torch


def lamb_update(weight: torch.Tensor, direction: torch.Tensor, lr: float,
                weight_decay: float) -> torch.Tensor:
    """The tensor after one LAMB step (a new tensor; ``weight`` is not changed)."""
    u = direction + weight_decay * weight  # decoupled weight decay joins the direction
    w_norm, u_norm = weight.norm(), u.norm()
    trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else torch.ones(())
    return weight - lr * trust * u
