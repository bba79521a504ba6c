"""ViT shapes, parameter count, patch reassembly, bad shapes; loss and weighted RMSE."""

import math

import pytest
import torch

from networks.backbone import count_parameters
from networks.vit import ViT, build_vit
from utils.config import DEFAULT_YAML, load_config
from utils.metrics import latitude_weights, relative_l2_loss, weighted_rmse_per_sample


def expected_parameters(c_in, c_out, p, d, depth, n_tokens, mlp_ratio=4):
    hidden = int(d * mlp_ratio)
    block = 2 * 2 * d + 4 * (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
    return (c_in * p * p * d + d) + n_tokens * d + depth * block + 2 * d + d * c_out * p * p + c_out * p * p


def test_output_shape_and_parameter_count():
    model = ViT((16, 32), 4, 20, 3, embed_dim=32, depth=2, num_heads=4)
    out = model(torch.randn(2, 20, 16, 32))
    assert out.shape == (2, 3, 16, 32)
    assert count_parameters(model) == expected_parameters(20, 3, 4, 32, 2, 4 * 8)


@pytest.mark.parametrize("name, millions", [("base", 23.83), ("mp", 157.93)])
def test_tutorial_model_sizes(name, millions):
    cfg = load_config(DEFAULT_YAML, name)
    n_tokens = (cfg.img_size[0] // cfg.patch_size) * (cfg.img_size[1] // cfg.patch_size)
    n = expected_parameters(20, 20, cfg.patch_size, cfg.embed_dim, cfg.depth, n_tokens)
    assert n / 1e6 == pytest.approx(millions, abs=0.01)
    if name == "base":
        with torch.device("meta"):  # no memory for the weights
            assert count_parameters(build_vit(cfg.model)) == n


def test_unpatchify_inverts_patch_order():
    model = ViT((8, 12), 4, 2, 2, embed_dim=8, depth=1, num_heads=2)
    img = torch.arange(2 * 8 * 12, dtype=torch.float32).reshape(1, 2, 8, 12)
    # patchify by hand: (B, C, gh, p, gw, p) -> (B, gh*gw, C*p*p), row-major over the grid
    patches = img.reshape(1, 2, 2, 4, 3, 4).permute(0, 2, 4, 1, 3, 5).reshape(1, 6, 32)
    torch.testing.assert_close(model.unpatchify(patches), img)


def test_bad_shapes():
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        ViT((10, 32), 4, 20, 20, embed_dim=32, depth=1, num_heads=4)
    with pytest.raises(ValueError, match="embed_dim 30 is not divisible by num_heads 4"):
        ViT((16, 32), 4, 20, 20, embed_dim=30, depth=1, num_heads=4)


def test_gradients_reach_every_parameter():
    model = ViT((16, 32), 4, 20, 20, embed_dim=32, depth=2, num_heads=4)
    relative_l2_loss(model(torch.randn(2, 20, 16, 32)), torch.randn(2, 20, 16, 32)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_weighted_rmse_hand_computed():
    # two rows at 90N and 0N: cos-lat weights (0, 1) normalised to mean 1 -> (0, 2)
    w = latitude_weights(2)
    torch.testing.assert_close(w.ravel(), torch.tensor([0.0, 2.0]), atol=1e-6, rtol=0)
    target = torch.zeros(1, 1, 2, 3)
    pred = torch.tensor([[[[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]]])
    # mean over cells of w * err^2 = (0*1 + 2*4) / 2 = 4 -> RMSE 2; the polar row does not count
    torch.testing.assert_close(weighted_rmse_per_sample(pred, target, w), torch.tensor([[2.0]]))
    # a constant error is its own RMSE whatever the weights (they average to 1)
    w4 = latitude_weights(4)
    const = torch.full((2, 3, 4, 5), 0.5)
    torch.testing.assert_close(weighted_rmse_per_sample(const, torch.zeros_like(const), w4),
                               torch.full((2, 3), 0.5))


def test_relative_l2_loss_hand_computed():
    target = torch.ones(1, 2, 2, 2)
    pred = target.clone()
    pred[0, 0] = 3.0  # channel 0: ||2||^2 * 4 / 4 = 4; channel 1: 0
    assert relative_l2_loss(pred, target).item() == pytest.approx(2.0)
    assert math.isclose(relative_l2_loss(target, target).item(), 0.0)
