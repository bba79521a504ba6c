"""Exercise (asynchronous training): PipeDream's planner.

Part 7's exercise (exercises/pipeline_balance_exercise.py) split layers into stages by compute
alone. PipeDream (Narayanan et al., SOSP 2019) also counts what a split costs to communicate,
and may replicate a stage: r workers each take every r-th mini-batch of it (data parallelism
inside the stage), at the price of all-reducing its weight gradients. Its asynchronous 1F1B
pipeline never flushes, so a mini-batch leaves it at the pace of its slowest part: a stage, or
the link at a stage boundary. Given per layer its compute time (forward and backward), its
output's size (what crosses a boundary after it) and its weights' size, choose contiguous
stages and how many workers each gets, using exactly ``workers`` workers, so that the slowest
part is as fast as it can be. The cost of each part is given below (read them: they are the
model); write the search.

Hint: dynamic programming over "layers 0 .. end - 1 on exactly m workers", as PipeDream's
planner does: either one stage replicated m times, or, for each start of the last stage and
each r of its workers, the best of layers 0 .. start - 1 on m - r workers, the boundary after
layer start - 1, and the last stage on r workers; the slowest of those three. Keep where the
best option came from to rebuild the stages.
"""


def stage_time(times: list[float], weights: list[float], first: int, last: int, replicas: int,
               bandwidth: float) -> float:
    """Time per mini-batch of a stage of layers first .. last - 1 on ``replicas`` workers: each
    replica computes every ``replicas``-th mini-batch, and the replicas all-reduce the stage's
    weight gradients (a ring moves 2 (r - 1) / r of them each way), which overlaps compute."""
    compute = sum(times[first:last])
    sync = 4 * (replicas - 1) * sum(weights[first:last]) / (replicas * bandwidth)
    return max(compute, sync) / replicas


def transfer_time(activations: list[float], layer: int, bandwidth: float) -> float:
    """Time per mini-batch of a stage boundary after ``layer``: its output forward and its gradient
    back; it overlaps the stages' compute, so it is a stage of the pipeline of its own."""
    return 2 * activations[layer] / bandwidth


def plan_pipeline(times: list[float], activations: list[float], weights: list[float], workers: int,
                  bandwidth: float) -> tuple[float, list[tuple[range, int]]]:
    """The time per mini-batch of the best plan and the plan: [(layers of the stage, its workers),
    ...] in order, covering every layer, with as many workers in all as ``workers``."""
    # TODO 1: best(end, m): the smallest slowest part for layers 0 .. end - 1 on exactly m workers,
    #         and the stages that give it (a dict or functools.cache for the table).
    # TODO 2: its options: one stage of all of them on m workers, or a split as the hint says.
    # TODO 3: best(len(times), workers), turned into [(range(first, last), replicas), ...].
    raise NotImplementedError("exercise: write plan_pipeline()")
