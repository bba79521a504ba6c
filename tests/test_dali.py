"""The DALI loader returns exactly what the PyTorch loader returns, in the same order."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nvidia.dali")

from utils.data_loader import get_data_loader  # noqa: E402
from utils.data_loader_dali import BatchSource, DALIBatches  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BATCH = 4


def batches(loader, epoch: int, start_batch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch, start_batch)
    return list(loader)


def assert_same(a, b) -> None:
    assert len(a) == len(b) > 0  # zip stops at the shorter: a loader that yields too few must fail
    for (x1, y1), (x2, y2) in zip(a, b):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)  # bit for bit


def pytorch_batches(cfg, split, train, epoch, start_batch=0, num_shards=1, shard_id=0):
    loader, _, sampler = get_data_loader(cfg, split, BATCH, train, num_shards, shard_id)
    sampler.set_epoch(epoch, start_batch)
    return list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_dali_equals_pytorch_train_and_valid(cfg_factory, workers):
    # n_out < n_in also checks that targets keep only the first n_out channels
    cfg = cfg_factory(num_data_workers=workers, limit_nsamples=30, limit_nsamples_val=10,
                      n_out_channels=18)
    train = DALIBatches(cfg, "train", BATCH, train=True)
    valid = DALIBatches(cfg, "valid", BATCH, train=False)
    for epoch in (0, 1):  # a different shuffle each epoch, the same pipeline reused
        assert_same(batches(train, epoch), pytorch_batches(cfg, "train", True, epoch))
        assert_same(batches(valid, epoch), pytorch_batches(cfg, "valid", False, epoch))
    assert train.batches_per_epoch == 30 // BATCH  # drop_last
    assert len(batches(valid, 0)[-1][0]) == 10 % BATCH  # validation keeps the partial batch
    train.close()
    valid.close()


def test_resume_mid_epoch_and_early_stop(cfg_factory):
    cfg = cfg_factory(num_data_workers=1, limit_nsamples=24)
    dali = DALIBatches(cfg, "train", BATCH, train=True)
    assert_same(batches(dali, 2, start_batch=3), pytorch_batches(cfg, "train", True, 2, 3))
    # an iteration stopped after one batch must not leak into the next epoch's start
    dali.set_epoch(0)
    next(iter(dali))
    assert_same(batches(dali, 1), pytorch_batches(cfg, "train", True, 1))
    dali.close()


def test_validation_before_training_takes_no_training_batch(cfg_factory):
    cfg = cfg_factory(num_data_workers=0, limit_nsamples=16, limit_nsamples_val=8)
    train = DALIBatches(cfg, "train", BATCH, train=True)
    valid = DALIBatches(cfg, "valid", BATCH, train=False)
    train.set_epoch(0)
    batches(valid, 0)  # evaluation first, as the tutorial's logging did
    assert_same(batches(train, 0), pytorch_batches(cfg, "train", True, 0))


def test_sharded_epoch_covers_the_set_disjointly(cfg_factory):
    cfg = cfg_factory(limit_nsamples=30)
    _, dataset, _ = get_data_loader(cfg, "train", BATCH, True)
    seen = []
    for shard in range(2):
        _, _, sampler = get_data_loader(cfg, "train", BATCH, True, num_shards=2, shard_id=shard)
        source = BatchSource(dataset, sampler, first_epoch=1, start_batch=0)
        shard_indices = [i for b in range(8) for i in source.batch_indices(0, b)]
        seen.append(set(shard_indices))
        assert len(shard_indices) == 30 // (2 * BATCH) * BATCH  # whole batches, same count per rank
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 30 // (2 * BATCH) * 2 * BATCH  # all but the dropped remainder
    # and the sharded DALI output equals the sharded PyTorch loader's
    dali = DALIBatches(cfg, "train", BATCH, train=True, num_shards=2, shard_id=1)
    assert_same(batches(dali, 1), pytorch_batches(cfg, "train", True, 1, num_shards=2, shard_id=1))
    dali.close()


def test_trainer_uses_dali_when_configured(cfg_factory, tmp_path):
    from training.context import RunContext
    from training.trainer import Trainer

    cfg = cfg_factory(data_loader_config="dali", num_iters=2)
    trainer = Trainer(cfg, RunContext(device=torch.device("cpu"), run_dir=tmp_path / "run"), BATCH)
    assert isinstance(trainer.train_data, DALIBatches)
    assert trainer.train_epoch(0, 0) == 2
    assert torch.isfinite(trainer.epoch_loss)


@pytest.mark.cuda
def test_gpu_pipeline_equals_pytorch(cfg_factory):
    cfg = cfg_factory(num_data_workers=1, limit_nsamples=16)
    dali = DALIBatches(cfg, "train", BATCH, train=True, device=torch.device("cuda", 0))
    got = [(x.cpu(), y.cpu()) for x, y in batches(dali, 0)]
    ref = pytorch_batches(cfg, "train", True, 0)
    assert len(got) == len(ref) == 4  # 16 samples in batches of 4; zip alone would stop at the shorter
    for (x1, y1), (x2, y2) in zip(got, ref):
        # normalisation runs on the GPU: division there may round differently in the last bit
        torch.testing.assert_close(x1, x2, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6)
    dali.close()


def test_dali_gets_its_buffers_back_only_after_the_copies_out_of_them(cfg_factory, monkeypatch):
    """On a GPU the copy out of each of DALI's output buffers is queued on torch's stream and runs
    later, while DALI may refill a buffer it got back (its next run(), an epoch's reset, a closed
    pipeline). The loader must wait for the copies first. A CPU copies at once, so the GPU's
    event is faked: whenever DALI is called, every earlier batch's event must have been waited for."""
    import utils.data_loader_dali as udl

    events = []

    class Event:
        waited = False

        def synchronize(self):
            self.waited = True

    def copies_done(device):
        events.append(Event())
        return events[-1]

    calls = []

    def checked(name, method):
        def call(*args, **kwargs):
            calls.append((name, all(e.waited for e in events)))
            return method(*args, **kwargs)
        return call

    build = DALIBatches._build

    def build_and_watch(self, *args):
        build(self, *args)
        self.pipe.run = checked("run", self.pipe.run)
        self.pipe.reset = checked("reset", self.pipe.reset)

    monkeypatch.setattr(udl.dev, "copies_done", copies_done)
    monkeypatch.setattr(DALIBatches, "_build", build_and_watch)
    cfg = cfg_factory(num_data_workers=0, limit_nsamples=16)
    dali = DALIBatches(cfg, "train", BATCH, train=True)
    assert_same(batches(dali, 0), pytorch_batches(cfg, "train", True, 0))
    assert len(events) == 16 // BATCH
    assert [n for n, _ in calls] == ["run"] * (16 // BATCH + 1) + ["reset"]
    dali.set_epoch(1)
    next(iter(dali))  # stopped early: the copies are still pending when the pipeline closes
    assert not events[-1].waited
    dali.close()
    assert events[-1].waited
    assert all(ok for _, ok in calls), calls
