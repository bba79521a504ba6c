"""Exercise (pipeline parallelism): balance the stages.

A pipeline runs at the pace of its slowest stage: in the steady state every stage waits for
the slowest one's micro-batch before it can go on. distributed/pipeline.py splits the blocks
as evenly as it can by count, but the stages are not equal: the first also embeds the patches,
the last runs the norm, the head and the loss. Given the measured cost (time) of each layer,
in order, assign contiguous layers to stages so that the largest stage cost is as small as
possible.

Every stage must get at least one layer, the stages keep the layers' order (stage 0 gets layers
0 .. a - 1, stage 1 layers a .. b - 1, and so on), and the result covers every layer.

Hint: dynamic programming over "the first i layers as k stages": the best largest stage for
(k, i) is the minimum over the start j of the last stage of max(best for (k - 1, j), the cost of
layers j .. i - 1). Keep where the last stage started to rebuild the ranges. (A binary search
over the answer with a greedy check also works.)
"""


def balance_stages(costs: list[float], n_stages: int) -> list[range]:
    """Split layers 0 .. len(costs) - 1 into ``n_stages`` contiguous, non-empty ranges so that the
    largest stage cost (the sum of its layers' costs) is as small as possible."""
    # TODO 1: prefix sums of costs, so that the cost of layers j .. i - 1 is one subtraction.
    # TODO 2: best[k][i] for k = 1 .. n_stages and i = k .. len(costs), and where stage k starts.
    # TODO 3: walk back from (n_stages, len(costs)) to build the list of ranges, in order.
    raise NotImplementedError("exercise: write balance_stages()")
