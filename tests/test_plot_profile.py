"""scripts/plot_profile.py: a torch.profiler trace drawn as a timeline of steps and phases."""

from __future__ import annotations

import json

import pytest

from scripts import plot_profile


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def ann(name, ts, dur, tid=7):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_steps_phases_and_the_wait_between_steps(tmp_path):
    events = [ann("step 3", 1000, 4000), ann("forward", 1100, 1500), ann("backward", 2700, 2000),
              ann("optimizer", 4750, 200), ann("step 4", 7000, 3000), ann("forward", 7100, 900),
              ann("Optimizer.step#Adam.step", 4760, 100),  # torch's own range: not a phase
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1200, "dur": 300, "pid": 1, "tid": 7},
              {"ph": "X", "cat": "cpu_op", "name": "aten::t", "ts": 1250, "dur": 10, "pid": 1, "tid": 7}]
    threads = plot_profile.timeline(plot_profile.read_trace(write_trace(tmp_path / "t.json", events)))
    rows = threads[7]
    assert [s[0] for s in rows["steps"]] == ["step 3", "step 4"]
    assert [p[0] for p in rows["phases"]] == ["forward", "backward", "optimizer", "forward"]
    assert rows["ops"] == [("op", 0.2, 0.5)]  # ms from the first event; the nested op is part of it
    assert plot_profile.data_waits(rows["steps"]) == [(4.0, 6.0)]  # step 3 ends at 4 ms, 4 starts at 6


def test_main_writes_a_picture_and_refuses_a_trace_without_steps(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.json", [ann("step 0", 0, 1000), ann("forward", 10, 500)])
    assert plot_profile.main(["--trace", str(trace), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000
    empty = write_trace(tmp_path / "e.json", [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0,
                                                "dur": 1, "pid": 1, "tid": 1}])
    assert plot_profile.main(["--trace", str(empty), "--out", str(tmp_path / "q.png")]) == 2
    assert "no training-step ranges" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_profile.main([])  # --run_dir or --trace is required
