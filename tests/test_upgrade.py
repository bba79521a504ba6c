"""The fused head-major q/k/v projection: its layout, and checkpoints of the older layout
(three separate q, k, v projections) that still load and resume exactly."""

from __future__ import annotations

import torch

from networks.vit import ViT, blocks_to_head_major, split_qkv
from training.context import RunContext
from training.trainer import Trainer
from utils import checkpoint as ckpt

HEADS = 4


def to_separate_qkv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of the upgrade: head-major qkv -> [q; k; v] blocks as q, k, v entries."""
    out = {}
    for name, t in tensors.items():
        if ".attn.qkv." not in name:
            out[name] = t
            continue
        rest = t.shape[1:]
        blocks = t.reshape(HEADS, 3, -1, *rest).transpose(0, 1).reshape(3, -1, *rest)
        for proj, part in zip("qkv", blocks):
            out[name.replace(".qkv.", f".{proj}.")] = part.clone()
    return out


def test_head_major_layout_gives_each_head_its_own_q_k_v():
    """Row block h of the fused weight is head h's q, k and v: a contiguous split of the rows
    over tensor-parallel ranks hands each rank whole heads."""
    dim, head_dim = 8, 2
    q, k, v = (torch.arange(dim * 1.0) + 100 * i for i in range(3))  # one "feature id" per row
    fused = blocks_to_head_major(torch.cat([q, k, v]), dim // head_dim)
    first_rank = fused[: fused.numel() // 2]  # tp = 2: the first half of the rows
    qs, ks, vs = split_qkv(first_rank.view(1, 1, -1), head_dim)
    assert qs.flatten().tolist() == [0, 1, 2, 3]  # heads 0 and 1: q features 0..3
    assert ks.flatten().tolist() == [100, 101, 102, 103] and vs.flatten().tolist() == [200, 201, 202, 203]


def test_fused_attention_equals_three_projections():
    torch.manual_seed(0)
    model = ViT((16, 32), 4, 20, 20, 32, 1, HEADS)
    attn = model.blocks["0"].attn
    x = torch.randn(2, 32, 32)
    sep = to_separate_qkv({"a.attn.qkv.weight": attn.qkv.weight.detach(), "a.attn.qkv.bias": attn.qkv.bias})
    q, k, v = (torch.nn.functional.linear(x, sep[f"a.attn.{p}.weight"], sep[f"a.attn.{p}.bias"])
               .view(2, 32, HEADS, 8).transpose(1, 2) for p in "qkv")
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    want = attn.proj(heads.transpose(1, 2).reshape(2, 32, 32))
    torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-6)


def old_layout(state: dict) -> dict:
    """A checkpoint as the older model wrote it: q, k, v weights and Adam moments apart."""
    names = list(state["model"])
    old_names = list(to_separate_qkv(state["model"]))
    per_param = {names[i]: s for i, s in state["optimizer"]["state"].items()}
    moments = {key: to_separate_qkv({n: s[key] for n, s in per_param.items()})
               for key in ("exp_avg", "exp_avg_sq")}
    steps = {n: per_param[n]["step"] for n in names}
    group = dict(state["optimizer"]["param_groups"][0], params=list(range(len(old_names))))
    fused_name = {n: n.replace(f".{p}.", ".qkv.") for n in old_names for p in "qkv" if f".attn.{p}." in n}
    optimizer = {"param_groups": [group],
                 "state": {i: {"step": steps[fused_name.get(n, n)], **{k: moments[k][n] for k in moments}}
                           for i, n in enumerate(old_names)}}
    return dict(state, model=to_separate_qkv(state["model"]), optimizer=optimizer)


def test_a_checkpoint_with_separate_qkv_resumes_exactly(cfg_factory, tmp_path):
    cfg = cfg_factory(num_iters=3)
    first = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "a"), 4)
    first.fit()
    old = old_layout(ckpt.load(first.checkpoint_path))
    assert ViT.upgrade_state_dict(old["model"], cfg.model) is not None
    ckpt.save_atomic(old, tmp_path / "b" / ckpt.CHECKPOINT_NAME)
    second = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "b"), 4)
    second.load_checkpoint(second.checkpoint_path)
    for (name, p), q in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(p, q), name
        a, b = first.optimizer.state[p], second.optimizer.state[q]
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq")), name
