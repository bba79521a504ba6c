"""Exercise (single device performance): one mixed-precision training step.

bf16 keeps fp32's exponent range, so autocast alone is enough; fp16 does not, so small
gradients underflow to zero unless the loss is scaled up before backward (GradScaler) and the
gradients scaled back down before the optimizer step. The loss is computed in fp32.
"""

import torch  # noqa: F401  (you will need it)


def amp_step(model, optimizer, scaler, loss_fn, inp, tar, device_type: str, dtype):
    """Forward under autocast, backward, optimizer step; returns the fp32 loss."""
    # TODO 1: run the forward pass under torch.autocast(device_type=..., dtype=...)
    # TODO 2: compute the loss in fp32 (outside autocast)
    # TODO 3: with a scaler: scale the loss for backward, step through the scaler, update it;
    #         without: plain backward and step. Then zero the gradients.
    raise NotImplementedError("exercise: write amp_step()")
