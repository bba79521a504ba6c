"""Exercise (freezing layers as training goes): the freeze schedule, and when a pipeline can
shrink.

1. PipeTransformer freezes a share alpha of the still active blocks after every epoch: after
   epoch e, ceil(L (1 - (1 - alpha)^e)) of the L blocks are frozen (the embedding with the
   first). With L = 12 and alpha = 1/3 that is 0, 4, 7, 9, 10, 11, 11, 12 after epochs 0 .. 7.
   Careful: in floating point 12 x (1 - (1 - 1/3)) is 4.000000000000001, and ceil makes it 5.

2. A pipeline runs at the pace of its costliest stage. As blocks freeze, the active ones are
   cut into stages again (a frozen prefix costs a sixth of its parameters, on the first stage).
   The run halves its number of stages (and doubles its data-parallel replicas) while the
   costliest stage of half as many stages costs no more than the costliest stage did at the
   start, or while there are fewer active blocks (items) than stages. ``split(items, n)`` cuts
   a list of costs into n contiguous stages with the smallest possible costliest stage
   (distributed/pipeline.py's ``balanced_split``, part 7's exercise).
"""

from collections.abc import Callable

Split = Callable[[list[float], int], list[range]]


def frozen_after(depth: int, alpha: float, epoch: int) -> int:
    """Blocks frozen after ``epoch`` epochs (never more than ``depth``)."""
    # TODO 1: the formula, with a guard against the rounding above (subtract a tiny amount
    # before ceil), and at most depth.
    raise NotImplementedError("exercise: write frozen_after()")


def stages_after(items_now: list[float], items_start: list[float], start_stages: int, split: Split) -> int:
    """The number of stages for the active blocks' costs ``items_now``, halving from
    ``start_stages``; ``items_start``: the costs when nothing was frozen."""
    # TODO 2: the costliest stage at the start: split items_start into start_stages stages and
    # take the largest sum.
    # TODO 3: halve while more than one stage is left and (there are fewer items than stages, or
    # the costliest of half as many stages of items_now is no costlier than that).
    raise NotImplementedError("exercise: write stages_after()")
