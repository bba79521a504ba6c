"""Reference solution of exercises/pipeline_balance_exercise.py (see there for the task)."""

from itertools import accumulate


def balance_stages(costs: list[float], n_stages: int) -> list[range]:
    """Split layers 0 .. len(costs) - 1 into ``n_stages`` contiguous, non-empty ranges so that the
    largest stage cost (the sum of its layers' costs) is as small as possible."""
    n = len(costs)
    prefix = [0.0, *accumulate(costs)]  # cost of layers j .. i - 1: prefix[i] - prefix[j]
    inf = float("inf")
    # best[k][i]: the smallest possible largest stage when layers 0 .. i - 1 form k stages;
    # cut[k][i]: where the last of those k stages starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):  # the k-th stage is layers j .. i - 1
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    ranges, end = [], n
    for k in range(n_stages, 0, -1):
        start = cut[k][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]
