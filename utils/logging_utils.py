"""Logging set-up: rank 0 logs INFO to the console and out.log; other ranks WARNING.

Until the run's log file exists (it is created only once the run is sure to start, so a
run that fails before training leaves nothing on disk), rank 0's records are kept in
memory and written to the file first when it is opened.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(message)s"
BUFFER_LIMIT = 10_000  # records kept before the log file exists (a start-up produces tens)


class _StartupBuffer(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < BUFFER_LIMIT:
            self.records.append(record)


def setup_logging(rank: int = 0, log_file: Path | None = None) -> None:
    """Console logging; with ``log_file`` (rank 0) also the file, starting with what was logged
    since the last call without one."""
    root = logging.getLogger()
    buffered = [r for h in root.handlers if isinstance(h, _StartupBuffer) for r in h.records]
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(FORMAT if rank == 0 else f"[rank {rank}] {FORMAT}")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank != 0:
        return
    if log_file is None:
        root.addHandler(_StartupBuffer())
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_file)
    file_handler.setFormatter(fmt)
    for record in buffered:
        file_handler.handle(record)
    root.addHandler(file_handler)
