"""The attention kernel: chosen once per device and precision, applied to every forward, kept on
resume, refused in one line where the device lacks it (utils/attention.py)."""


import pytest
import torch

from tests.conftest import REPO  # noqa: F401  (puts the repository on sys.path)
from training.context import RunContext
from training.trainer import Trainer
from utils import attention

CPU = torch.device("cpu")


def test_auto_is_a_rule_from_the_measured_table():
    assert attention.choose("auto", CPU, torch.float32, 128) == "default"
    assert attention.choose("auto", CPU, torch.bfloat16, 128) == "math"  # short: flash's backward is slow
    assert attention.choose("auto", CPU, torch.bfloat16, attention.BF16_FLASH_FROM) == "default"
    assert attention.choose("auto", CPU, torch.float16, 4096) == "math"
    assert attention.choose("auto", torch.device("cuda", 0), torch.bfloat16, 128) == "default"
    assert attention.choose("math", CPU, torch.float32, 128) == "math"  # a name: as given


def test_cpu_kernels_are_timed_forward_and_backward():
    times = attention.time_kernels((2, 2, 16, 8), 16, torch.bfloat16, CPU, reps=1)
    assert {"default", "flash", "math"} <= set(times) and not {"efficient", "cudnn"} & set(times)
    assert all(f > 0 and b > 0 for f, b in times.values())


def _attention_ops(trainer: Trainer, cfg) -> set[str]:
    inp = torch.randn(2, cfg.n_in_channels, *cfg.img_size)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.forward_loss(inp, torch.randn(2, cfg.n_out_channels, *cfg.img_size)).backward()
    return {e.name for e in prof.events() if "scaled_dot_product" in e.name}


@pytest.mark.parametrize("amp_mode", ["none", "bf16"])
def test_the_trainer_runs_its_kernel(cfg_factory, tmp_path, amp_mode):
    """Forward (and so backward) under the trainer's region takes the configured kernel."""
    for name, op in (("math", "aten::_scaled_dot_product_attention_math"),
                     ("flash", "aten::_scaled_dot_product_flash_attention_for_cpu")):
        cfg = cfg_factory(attention_kernel=name, amp_mode=amp_mode)
        trainer = Trainer(cfg, RunContext(device=CPU, run_dir=tmp_path / name), 2)
        assert trainer.attention_kernel == name
        ops = _attention_ops(trainer, cfg)
        assert op in ops and not any("flash" in o for o in ops if name == "math"), ops


def test_a_resumed_run_keeps_the_kernel_it_started_with(cfg_factory, tmp_path, monkeypatch):
    from training import checkpointing

    cfg = cfg_factory(amp_mode="bf16", num_iters=2)  # 32 tokens: math
    first = Trainer(cfg, RunContext(device=CPU, run_dir=tmp_path / "run"), 2)
    first.save_checkpoint()
    monkeypatch.setattr(attention, "BF16_FLASH_FROM", 16)  # a later version's rule: flash here
    second = Trainer(cfg, RunContext(device=CPU, run_dir=tmp_path / "run"), 2)
    assert (first.attention_kernel, second.attention_kernel) == ("math", "default")
    second.load_checkpoint(checkpointing.find(tmp_path / "run"))
    assert second.attention_kernel == "math"


def test_which_kernel_a_resumed_run_keeps():
    from training.state import kept_attention_kernel

    assert kept_attention_kernel("flash", "flash", "math", CPU) == "flash"  # named on the command line
    assert kept_attention_kernel("auto", "math", "cudnn", CPU) == "math"  # a GPU run's cudnn on a CPU
    assert kept_attention_kernel("auto", "math", None, CPU) == "math"  # a checkpoint from before the key
    assert kept_attention_kernel("auto", "default", "math", CPU) == "math"  # the run's own choice


def test_a_gpu_only_kernel_on_cpu_is_one_line(cfg_factory, tmp_path, capsys):
    from ruamel.yaml import YAML

    from training.launcher import main

    yaml = tmp_path / "t.yaml"
    with open(yaml, "w") as f:
        YAML().dump({"t": cfg_factory().to_dict()}, f)
    code = main(argv=["--yaml_config", str(yaml), "--config", "t", "--attention_kernel", "cudnn"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: attention_kernel cudnn runs only on CUDA GPUs; on cpu use auto, default, flash or math")
    assert not (tmp_path / "logs").exists()  # nothing written for a run that cannot start
