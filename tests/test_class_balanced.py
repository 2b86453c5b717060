"""Class-balanced sampling (data.class_balanced, CBGS): the pool's draws per class against a hand count, the epoch
order over the pool (every rank, every epoch), each sample's classes as the dataset yields them, the trainer's epoch
from the CLI, and the errors for a config or a dataset that cannot balance."""
import collections
import re

import pytest
import torch

from lss.config import ConfigError, load_config
from lss.data.samplers import EpochSampler, class_balanced_pool, class_balanced_training_pool


def test_every_class_present_fills_an_equal_share_of_the_pool():
    classes = [[0], [0], [0], [0], [0, 1], [], [2], [0, 0]]
    pool = class_balanced_pool(classes, seed=3)
    # (sample, class) pairs: class 0 in 6 samples, 1 and 2 in one each: 8 pairs, 3 classes: 2 draws per class
    assert len(pool) == 3 * (8 // 3) + 1
    counts = collections.Counter(pool)
    assert counts[6] == 2  # class 2's only sample, drawn twice
    assert counts[4] >= 2  # class 1's only sample (it holds class 0 too)
    assert counts[5] == 1  # the sample without a class, once
    assert pool[-1] == 5
    assert all(i in (0, 1, 2, 3, 4, 7) for i in pool[:2])  # class 0's draws come first, from its holders
    assert pool == class_balanced_pool(classes, seed=3)  # a function of the seed
    many = [[0]] * 90 + [[1]] * 9 + [[2]]
    draws = [class_balanced_pool(many, seed=s) for s in range(2)]
    assert draws[0] != draws[1]
    for pool in draws:
        share = collections.Counter(many[i][0] for i in pool)
        assert share == {0: 33, 1: 33, 2: 33}  # 100 pairs, 3 classes
    assert class_balanced_pool([[], []]) == [0, 1]


def test_an_epoch_is_a_shuffle_of_the_pool_on_every_rank():
    pool = class_balanced_pool([[0]] * 10 + [[1], [2]], seed=0)
    for epoch in range(2):
        single = EpochSampler(len(pool), seed=1, pool=pool, pad=False)
        single.set_epoch(epoch)
        assert sorted(single) == sorted(pool)
        shards = []
        for rank in range(2):
            sampler = EpochSampler(len(pool), seed=1, rank=rank, world_size=2, pool=pool)
            sampler.set_epoch(epoch)
            shards += list(sampler)
        assert sorted(shards) == sorted(pool)  # 12 draws, even: no padding
    with pytest.raises(ValueError, match="the pool has 12 indices, length is 5"):
        EpochSampler(5, pool=pool)


def test_the_dataset_lists_the_classes_its_items_carry_and_the_trainer_draws_its_pool(synthetic_root, tmp_path,
                                                                                      capsys):
    from lss.cli import main
    from lss.data.loader import build_dataset

    sets = [f"data.dataroot={synthetic_root}", "data.make_synthetic_if_missing=false", "data.workers=0",
            "data.final_dim=[64,192]", "data.resize_lim=[0.46,0.5]", "model.pretrained=null", "train.device=cpu",
            "train.max_steps=2", "train.eval_every=0", "train.ckpt_every=2", "train.viz_every=0",
            "train.batch_size=2", "eval.batch_size=2", "model.heads=[segmentation,detection]",
            "detection.head_channels=8", "data.class_balanced=true"]
    cfg = load_config("configs/synthetic_segmentation.yaml", sets)
    dataset = build_dataset(cfg, cfg.data.train_split, True, verbose=False)
    for i in range(len(dataset)):
        carried = sorted(set(dataset[i]["det_labels"].tolist()))
        assert dataset.detection_classes(i).tolist() == carried
    pool = class_balanced_training_pool(dataset, cfg.train.seed)
    assert any(dataset.detection_classes(i).size for i in range(len(dataset)))
    args = ["train", "--config", "configs/synthetic_segmentation.yaml", "--out", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    torch.manual_seed(0)
    assert main(args) == 0
    line = re.search(r"\((\d+) class-balanced draws an epoch\)", capsys.readouterr().out)
    assert line and int(line.group(1)) == len(pool)


def test_a_config_or_dataset_that_cannot_balance_is_refused():
    with pytest.raises(ConfigError, match="data.class_balanced: true balances the training samples by their "
                                          "detection classes"):
        load_config("configs/synthetic_segmentation.yaml", ["data.class_balanced=true"])
    with pytest.raises(ConfigError, match="a dataset that lists each sample's detection classes"):
        class_balanced_training_pool(torch.utils.data.TensorDataset(torch.zeros(3)), 0)
