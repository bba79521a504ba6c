"""Exercise (single device training): which file and time step hold sample i?

Samples are pairs (fields[t], fields[t + dt]) taken from one year file at a time, so a file
of T steps gives T - dt samples, and sample numbers run over the files in order.
"""

import numpy as np


def locate(index: int, steps_per_file: list[int], dt: int) -> tuple[int, int]:
    """Global sample number -> (file number, time step t of the input within that file)."""
    samples_per_file = [t - dt for t in steps_per_file]
    for file_no, n in enumerate(samples_per_file):
        if index < n:
            return file_no, index
        index -= n
    raise IndexError("sample number past the last file")


def normalise(fields: np.ndarray, means: np.ndarray, stds: np.ndarray) -> np.ndarray:
    """(C, H, W) fields with (1, C, 1, 1) global statistics -> zero mean, unit spread per channel."""
    return (fields - means[0]) / stds[0]
