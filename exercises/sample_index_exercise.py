"""Exercise (single device training): which file and time step hold sample i?

Samples are pairs (fields[t], fields[t + dt]) taken from one year file at a time, so a file
of T steps gives T - dt samples, and sample numbers run over the files in order.
"""

import numpy as np


def locate(index: int, steps_per_file: list[int], dt: int) -> tuple[int, int]:
    """Global sample number -> (file number, time step t of the input within that file)."""
    # TODO: walk over the files; a file of T steps holds T - dt samples. A pair must never
    # cross into the next file. Raise IndexError past the last file.
    raise NotImplementedError("exercise: write locate()")


def normalise(fields: np.ndarray, means: np.ndarray, stds: np.ndarray) -> np.ndarray:
    """(C, H, W) fields with (1, C, 1, 1) global statistics -> zero mean, unit spread per channel."""
    # TODO: one line; mind the shapes of the statistics.
    raise NotImplementedError("exercise: write normalise()")
