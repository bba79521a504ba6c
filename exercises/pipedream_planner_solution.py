"""Reference solution of exercises/pipedream_planner_exercise.py (see there for the task)."""

from functools import cache


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
    n = len(times)

    @cache
    def best(end: int, m: int) -> tuple[float, tuple[tuple[int, int], ...]]:
        # layers 0 .. end - 1 on exactly m workers: one stage replicated m times, or the best
        # split into layers 0 .. start - 1 on m - r workers and a last stage start .. end - 1 on r
        options = [(stage_time(times, weights, 0, end, m, bandwidth), ((0, m),))]
        for start in range(1, end):
            for r in range(1, m):
                before, stages = best(start, m - r)
                worst = max(before, transfer_time(activations, start - 1, bandwidth),
                            stage_time(times, weights, start, end, r, bandwidth))
                options.append((worst, stages + ((start, r),)))
        return min(options, key=lambda o: o[0])

    slowest, stages = best(n, workers)
    ends = [start for start, _ in stages[1:]] + [n]
    return slowest, [(range(start, end), r) for (start, r), end in zip(stages, ends)]
