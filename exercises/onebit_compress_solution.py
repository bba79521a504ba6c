"""Exercise (communication): 1-bit compression with error feedback, the heart of 1-bit Adam.

A rank sends a tensor x as its signs and one scale, and keeps what that left out for the next
step (distributed/onebit_adam.py does it for the flat momentum, twice a step):

    y     = x + error                       (last step's leftover added back)
    scale = ||y|| / sqrt(n)                 (n: the number of elements; the RMS of y)
    sent  = scale * sign(y)                 (sign(0) = +1)
    error = y - sent                        (the new leftover)

Write ``compress_with_feedback``; the check also proves that over many steps nothing is lost:
the sum of what was sent plus the last error is the sum of the inputs.
"""

import math

import torch


def compress_with_feedback(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What is sent for ``x`` (the scale times the signs) and the error to keep (new tensors)."""
    y = x + error  # the error of the step before joins the input
    scale = y.norm() / math.sqrt(y.numel())
    sent = torch.where(y >= 0, scale, -scale)
    return sent, y - sent
