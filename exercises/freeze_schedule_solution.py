"""Reference solution of exercises/freeze_schedule_exercise.py (see there for the task)."""

import math
from collections.abc import Callable

Split = Callable[[list[float], int], list[range]]


def frozen_after(depth: int, alpha: float, epoch: int) -> int:
    """Blocks frozen after ``epoch`` epochs (never more than ``depth``)."""
    return min(depth, math.ceil(depth * (1 - (1 - alpha) ** epoch) - 1e-9))


def stages_after(items_now: list[float], items_start: list[float], start_stages: int, split: Split) -> int:
    """The number of stages for the active blocks' costs ``items_now``, halving from
    ``start_stages``; ``items_start``: the costs when nothing was frozen."""
    def costliest(items: list[float], stages: int) -> float:
        return max(sum(items[i] for i in r) for r in split(items, stages))

    reference = costliest(items_start, start_stages)
    stages = start_stages
    while stages > 1 and (len(items_now) < stages or costliest(items_now, stages // 2) <= reference):
        stages //= 2
    return stages
