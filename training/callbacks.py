"""Where a script or a test hooks into a run: a few named moments of training/trainer.py's loop.
Scripts that measure a run (scripts/cost_measure.py, sharding_report.py, pipeline_report.py,
benchmark.py) and tests that inject faults pass a list of callbacks to the Trainer (or to
training/launcher.py's ``main``) instead of changing the loop."""

from __future__ import annotations

from typing import Any

import torch


class Callback:
    """A script's or a test's hook into a run: override the moments you need (each does nothing
    here). The Trainer calls them in the order the callbacks were given."""

    def model_built(self, trainer: Any) -> None:
        """The model and optimizer exist (before any step or checkpoint load)."""

    def step_start(self, trainer: Any) -> None:
        """A training step is about to run on a batch already on the device (``trainer.step``
        steps are done)."""

    def step_end(self, trainer: Any, loss: torch.Tensor) -> torch.Tensor | None:
        """The step ran (``trainer.step`` not yet counted up); ``loss`` is the device tensor it
        returned. Return a tensor to log instead (fault injection), or None."""
        return None

    def epoch_end(self, trainer: Any, epoch: int) -> None:
        """An epoch was trained, validated and logged."""

    def fit_end(self, trainer: Any) -> None:
        """Training is over (checkpoint written); ``trainer.stopped_early`` says whether a stop
        signal ended it, ``trainer.next_layout`` whether the run goes on in another layout (with
        a new Trainer, whose fit_end comes later: training/freezing.py)."""
