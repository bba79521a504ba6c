"""Exercise (DeepSpeed): the training state each rank holds at each ZeRO stage.

Mixed-precision Adam, as the ZeRO paper counts it, per parameter: 2 bytes of bf16 (or fp16)
weights, 2 bytes of gradients, and K = 12 bytes of optimizer state (an fp32 master copy of the
weight, Adam's two fp32 moments). On N data-parallel ranks:

    stage 0   every rank holds all of it                      (plain data parallelism)
    stage 1   the optimizer state is split over the N ranks   (P_os)
    stage 2   ... and the gradients                           (P_os+g)
    stage 3   ... and the weights                             (P_os+g+p)

Write ``zero_bytes_per_rank``: the bytes of each kind one rank holds.
"""


def zero_bytes_per_rank(params: int, ranks: int, stage: int, weight_bytes: int = 2,
                        grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """{"parameters": ..., "gradients": ..., "optimizer_state": ...} in bytes, on one of ``ranks``."""
    # TODO 1: the whole model's bytes of each kind (params times bytes per parameter)
    # TODO 2: divide by the ranks what the stage partitions: stage >= 1 the optimizer state,
    #         stage >= 2 the gradients, stage 3 the weights
    raise NotImplementedError("exercise: write zero_bytes_per_rank()")
