"""Solution (DeepSpeed): the training state each rank holds at each ZeRO stage."""


def zero_bytes_per_rank(params: int, ranks: int, stage: int, weight_bytes: int = 2,
                        grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """{"parameters": ..., "gradients": ..., "optimizer_state": ...} in bytes, on one of ``ranks``."""
    whole = {"parameters": params * weight_bytes, "gradients": params * grad_bytes,
             "optimizer_state": params * optimizer_bytes}
    split = {"optimizer_state": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    return {kind: size / ranks if split[kind] else size for kind, size in whole.items()}
