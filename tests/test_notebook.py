"""start_tensorboard.ipynb, executed headlessly, serves the run's scalars over HTTP."""

import json
import os
import signal
import time
import urllib.parse
import urllib.request

import pytest
import torch

from tests.conftest import REPO
from training.context import RunContext
from training.trainer import Trainer

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def get_json(port, path, **query):
    url = f"http://127.0.0.1:{port}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def running_tensorboards(logdir):
    from tensorboard import manager

    return [info for info in manager.get_all() if os.path.abspath(info.logdir) == os.path.abspath(logdir)]


@pytest.mark.timeout(240)
def test_notebook_serves_loss_scalars(cfg_factory, tmp_path):
    logs = tmp_path / "logs"
    cfg = cfg_factory(limit_nsamples=8, num_iters=6)  # 2 steps per epoch: 3 epochs logged
    Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=logs / "tiny" / "1GPU" / "00"),
            cfg.global_batch_size).fit()

    nb = nbformat.read(REPO / "start_tensorboard.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and params[0].source.startswith("log_dir = ")
    params[0].source = f"log_dir = {str(logs)!r}"
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    try:
        # TensorBoard is a child of the kernel: check it while the kernel is still alive
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
            servers = running_tensorboards(logs)
            assert servers, "the notebook did not start TensorBoard"
            check_scalars(servers[0].port)
    finally:
        for info in running_tensorboards(logs):
            os.kill(info.pid, signal.SIGTERM)


def check_scalars(port):
    deadline = time.time() + 60
    tags = {}
    while time.time() < deadline:  # TensorBoard reads the event files in the background
        tags = get_json(port, "/data/plugin/scalars/tags")
        if tags and all("Loss/valid" in t for t in tags.values()):
            break
        time.sleep(1)
    assert list(tags) == ["tiny/1GPU/00"], tags
    for tag in ("Loss/train", "Loss/valid"):
        points = get_json(port, "/data/plugin/scalars/scalars", tag=tag, run="tiny/1GPU/00")
        assert [p[1] for p in points] == [2, 4, 6], (tag, points)  # [wall time, step, value]
