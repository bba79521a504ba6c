"""Exercise (cost model): predict the activation memory of one transformer block, then check it.

Autograd keeps, for backward, tensors that forward made. For one pre-norm block of this
course's ViT (networks/vit.py), per token, in fp32:

    x, the block's input (saved by the first layer norm)            D
    the first layer norm's output (saved by the q/k/v projection)    D
    the q/k/v projection's output (saved by attention)               3 D / tp
    attention's output (saved by the output projection)              D / tp
    attention's log-sum-exp, one per head (saved for its backward)   h / tp
    x after attention (saved by the second layer norm)               D
    the second layer norm's output (saved by fc1)                    D
    fc1's output (saved by GELU) and GELU's output (saved by fc2)    2 F / tp
    each layer norm's mean and 1/std                                 2 + 2

Tensor parallelism (tp ranks) splits the heads and the MLP's hidden features: what lives
between the column- and row-parallel layers is divided by tp; the norms' inputs and outputs
stay whole on every rank.

Write ``block_activation_bytes``: the bytes one rank keeps for ``batch`` samples of ``tokens``
tokens. Then compare with the cost model and a real run:

    python scripts/cost_model.py --config tiny --ranks 2 --tensor_parallel 2
    python scripts/cost_model.py --check --only tp2
"""


def block_activation_bytes(batch: int, tokens: int, dim: int, hidden: int, heads: int, tp: int = 1,
                           element_bytes: int = 4) -> int:
    """Bytes one block keeps for backward on one of ``tp`` tensor-parallel ranks."""
    # TODO 1: the elements per token every tp rank keeps whole (the table's rows without "/ tp")
    # TODO 2: the elements per token split over the tp ranks (the rows with "/ tp")
    # TODO 3: times the tokens of the batch and the bytes per element
    raise NotImplementedError("exercise: write block_activation_bytes()")
