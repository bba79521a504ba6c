"""Config loading: merge keys, None, unknown names and keys, types, overrides, immutability."""

import dataclasses

import pytest

from utils.config import DEFAULT_YAML, available_configs, load_config, with_overrides

TUTORIAL_CONFIGS = ["base", "short", "short_opt", "opt", "mp", "mp_bs16", "mp_bs32", "mp_patch4",
                    "tiny", "tiny_short", "small"] + [f"bs{2**k}_opt" for k in range(4, 12)]


def write_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_every_named_config_loads():
    names = available_configs()
    for name in TUTORIAL_CONFIGS:
        assert name in names
    for name in names:
        load_config(DEFAULT_YAML, name)


def test_base_matches_tutorial():
    cfg = load_config(DEFAULT_YAML, "base")
    assert (cfg.embed_dim, cfg.depth, cfg.patch_size, cfg.num_heads) == (384, 12, 8, 8)
    assert cfg.img_size == (360, 720) and cfg.global_batch_size == 16 and cfg.num_iters == 30000
    assert cfg.lr == 5e-4 and cfg.lr_schedule == "cosine" and cfg.n_in_channels == 20
    assert cfg.limit_nsamples is None  # the string 'None' in YAML
    short = load_config(DEFAULT_YAML, "short")
    assert (short.limit_nsamples, short.limit_nsamples_val, short.num_iters) == (512, 128, 128)
    assert short.embed_dim == 384  # merged from base


def test_square_root_lr_scaling():
    for k in range(4, 12):
        bs = 2**k
        cfg = load_config(DEFAULT_YAML, f"bs{bs}_opt")
        assert cfg.global_batch_size == bs
        assert cfg.lr == pytest.approx(5e-4 * (bs / 16) ** 0.5, rel=5e-3)  # YAML keeps 3 significant digits
    assert load_config(DEFAULT_YAML, "bs2048_opt").lr == 5.66e-3


def test_unknown_config_lists_available():
    with pytest.raises(ValueError, match=r"unknown config 'shrot'.*available:.*short"):
        load_config(DEFAULT_YAML, "shrot")


def test_misspelled_key_is_an_error(tmp_path):
    path = write_yaml(tmp_path, "a:\n  embed_dims: 12\n")
    with pytest.raises(ValueError, match=r"unknown config key 'embed_dims'.*did you mean 'embed_dim'"):
        load_config(path, "a")


@pytest.mark.parametrize("text, message", [
    ("a:\n  depth: twelve\n", r"'depth' must be int"),
    ("a:\n  depth: 1.5\n", r"'depth' must be int"),
    ("a:\n  enable_jit: 1\n", r"'enable_jit' must be bool"),
    ("a:\n  img_size: [360]\n", r"'img_size' must be tuple"),
    ("a:\n  amp_mode: fp8\n", r"amp_mode.*choose one of none, fp16, bf16"),
    ("a:\n  patch_size: 7\n", r"not divisible by patch_size 7"),
    ("a:\n  num_heads: 5\n", r"embed_dim 384 is not divisible by num_heads 5"),
    ("a:\n  global_batch_size: 0\n", r"'global_batch_size' must be at least 1"),
    # keys that only another layout reads: ignored without a word before, refused now
    ("a:\n  dp_shard: 2\n", r"--dp_shard 2 sizes hsdp's sharding groups; this run would ignore it"),
    ("a:\n  reshard_after_forward: False\n", r"--no-reshard_after_forward keeps FSDP's gathered weights"),
    ("a:\n  pipeline_schedule: gpipe\n", r"use it with --pipeline_parallel 2 or more"),
    ("a:\n  num_experts: 4\n  moe_every: 13\n", r"--moe_every 12 or less \(the model has 12 blocks\)"),
    ("a:\n  async_drain_every: 10\n", r"--async_drain_every 10 spaces the asynchronous pipeline's drains; "
                                       r"this run would ignore it"),
    ("a:\n  weight_stashing: 2bw\n", r"--weight_stashing 2bw picks the weights of the asynchronous "
                                     r"pipeline's backward; this run would ignore it: use it with"),
    # every number finite: inf and nan pass a "< 0" check
    ("a:\n  freeze_cache_mib: .inf\n", r"config key 'freeze_cache_mib' must be a finite number, got inf"),
    ("a:\n  lr: .nan\n", r"config key 'lr' must be a finite number, got nan"),
])
def test_bad_values(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_config(write_yaml(tmp_path, text), "a")


def test_merge_keys_and_override_order(tmp_path):
    path = write_yaml(tmp_path, "a: &a\n  depth: 3\n  lr: 1.0e-3\nb:\n  <<: *a\n  lr: 2.0e-3\n")
    b = load_config(path, "b")
    assert (b.depth, b.lr) == (3, 2e-3)


def test_overrides_only_when_given_and_config_is_frozen():
    cfg = load_config(DEFAULT_YAML, "short_opt")
    assert cfg.enable_fused and cfg.num_data_workers == 8
    same = with_overrides(cfg, enable_fused=None, num_data_workers=None)
    assert same == cfg
    changed = with_overrides(cfg, enable_fused=False, num_data_workers=0)
    assert changed.enable_fused is False and changed.num_data_workers == 0
    assert cfg.enable_fused is True  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(ValueError, match="'num_iters' must be at least 1"):
        with_overrides(cfg, num_iters=0)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", "base")
