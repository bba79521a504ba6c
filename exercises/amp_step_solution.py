"""Exercise (single device performance): one mixed-precision training step.

bf16 keeps fp32's exponent range, so autocast alone is enough; fp16 does not, so small
gradients underflow to zero unless the loss is scaled up before backward (GradScaler) and the
gradients scaled back down before the optimizer step. The loss is computed in fp32.
"""

import torch


def amp_step(model, optimizer, scaler, loss_fn, inp, tar, device_type: str, dtype):
    """Forward under autocast, backward, optimizer step; returns the fp32 loss."""
    with torch.autocast(device_type=device_type, dtype=dtype):
        pred = model(inp)
    loss = loss_fn(pred.float(), tar)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
