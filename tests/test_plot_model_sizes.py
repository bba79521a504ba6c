"""scripts/plot_model_sizes.py: final RMSE of finished runs against their parameter counts."""

from __future__ import annotations

import json

import pytest

from networks.backbone import count_parameters
from networks.vit import build_vit
from scripts import plot_model_sizes
from training.launcher import write_resolved_config


def fake_run(path, cfg, name, rmse):
    write_resolved_config(cfg, path, name)
    line = {"step": 8, "val_loss": rmse / 10, "rmse": {"u10m": rmse, "t2m": rmse + 0.2},
            "persistence": {"u10m": 0.5, "t2m": 0.7}}
    (path / "metrics.jsonl").write_text(json.dumps({**line, "step": 4}) + "\n" + json.dumps(line) + "\n")
    return path


def test_runs_summarised_and_drawn(cfg_factory, tmp_path, capsys):
    small, large = cfg_factory(embed_dim=16), cfg_factory(embed_dim=32)
    runs = [fake_run(tmp_path / "a", large, "big", 0.1), fake_run(tmp_path / "b", small, "little", 0.3)]
    summary = plot_model_sizes.run_summary(runs[0])
    assert summary["parameters"] == count_parameters(build_vit(large.model)) and summary["step"] == 8
    assert summary["rmse"] == pytest.approx(0.2) and summary["persistence"] == pytest.approx(0.6)
    out = tmp_path / "sizes.png"
    assert plot_model_sizes.main(["--run_dirs", *map(str, runs), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("little: ") and printed[1].startswith("big: ")  # smallest first


def test_a_folder_without_a_finished_run_is_one_line(tmp_path, capsys):
    assert plot_model_sizes.main(["--run_dirs", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path} is not a finished run (no metrics.jsonl " \
                                              f"or config.yaml)"
