from __future__ import annotations

import lightning
import pytest
import torch

from gr_plugin.data import InteractionLog, RecDataModule, RequestBatch, split_visits
from gr_plugin.data import datamodule as datamodule_mod

KW = {"batch_size": 8, "num_candidates": 32, "max_next": 4, "max_visit_len": 16, "seed": 0}


def _first(loader: torch.utils.data.DataLoader) -> RequestBatch:
    return next(iter(loader))


def _same_batch(a: RequestBatch, b: RequestBatch) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


def _per_user_split(log: InteractionLog) -> dict[int, tuple[int, list[int], list[int]]]:
    """user id -> (training prefix end, val starts, test starts) for KW's visits, 2 val + 2 test."""
    visits = split_visits(log, max_visit_len=KW["max_visit_len"])
    out = {}
    for u in range(log.num_users):
        starts = [s for s, _ in visits.of_user(u)]
        held = starts[-4:]
        out[int(log.user_ids[u])] = (held[0] if held else int(log.lengths[u]), held[:-2], held[-2:])
    return out


@pytest.fixture
def dm(synth: InteractionLog) -> RecDataModule:
    dm = RecDataModule(synth, **KW)
    dm.setup("fit")
    return dm


def test_one_batch_from_each_loader(dm: RecDataModule, synth: InteractionLog) -> None:
    assert dm.num_items == synth.num_items
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        batch = _first(loader)
        assert isinstance(batch, RequestBatch)
        assert 1 <= batch.batch_size <= KW["batch_size"]
        assert (batch.candidate_lengths == KW["num_candidates"]).all()
        assert int(batch.history_lengths.max()) <= dm.max_history_len_seen
    assert len(dm.train_dataloader()) == -(-synth.num_users // KW["batch_size"])


def test_time_split_per_user(dm: RecDataModule, synth: InteractionLog) -> None:
    split = _per_user_split(synth)
    for batch in dm.train_dataloader():
        for uid, n in zip(batch.user_ids.tolist(), batch.history_lengths.tolist()):
            assert n < split[uid][0]  # the cut and its next items lie in the training prefix
    for stage, which in (("val", 1), ("test", 2)):
        seen = {}
        for batch in getattr(dm, f"{stage}_dataloader")():
            for uid, n, v in zip(
                batch.user_ids.tolist(), batch.history_lengths.tolist(), batch.visit_index.tolist()
            ):
                seen.setdefault(uid, []).append((v, n))
        assert seen == {uid: list(enumerate(s[which])) for uid, s in split.items() if s[which]}


def test_training_positives_stay_before_the_held_out_visits(synth: InteractionLog) -> None:
    split = _per_user_split(synth)
    dm = RecDataModule(synth, **{**KW, "batch_size": 64})
    batch = _first(dm.train_dataloader())
    off = batch.candidate_offsets.tolist()
    for i, (uid, n) in enumerate(zip(batch.user_ids.tolist(), batch.history_lengths.tolist())):
        u = synth.user_ids.tolist().index(uid)
        items = synth.history(u)["item_ids"].tolist()
        watched = batch.candidate_items[off[i] : off[i + 1]][batch.labels[off[i] : off[i + 1], 1] == 1]
        expected = set(items[n : min(n + KW["max_next"], split[uid][0])])
        assert set(watched.tolist()) == expected


def test_eval_replays_returning_users(dm: RecDataModule) -> None:
    users = [u for b in dm.val_dataloader() for u in b.user_ids.tolist()]
    assert len(users) > len(set(users))  # users come back within the stage
    assert max(v for b in dm.predict_dataloader() for v in b.visit_index.tolist()) >= 3


def test_deterministic_for_a_seed(synth: InteractionLog) -> None:
    a, b, c = (RecDataModule(synth, **{**KW, "seed": s}) for s in (0, 0, 1))
    assert _same_batch(_first(a.train_dataloader()), _first(b.train_dataloader()))
    assert not _same_batch(_first(a.train_dataloader()), _first(c.train_dataloader()))
    for x, y in zip(a.val_dataloader(), b.val_dataloader()):
        assert _same_batch(x, y)


def test_new_epoch_new_cuts(dm: RecDataModule) -> None:
    loader = dm.train_dataloader()

    def cuts() -> dict[int, int]:
        return {u: n for b in loader for u, n in zip(b.user_ids.tolist(), b.history_lengths.tolist())}

    epoch0 = cuts()
    loader.sampler.set_epoch(1)
    epoch1 = cuts()
    assert epoch0.keys() == epoch1.keys()
    assert sum(epoch0[u] != epoch1[u] for u in epoch0) > len(epoch0) // 2
    loader.sampler.set_epoch(0)
    assert cuts() == epoch0


def test_max_users_and_max_history_len(synth: InteractionLog) -> None:
    dm = RecDataModule(synth, **KW, max_users=10, max_history_len=64)
    dm.setup("fit")
    assert dm.log.num_users == 10
    lengths = [
        n
        for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader())
        for b in loader
        for n in b.history_lengths.tolist()
    ]
    assert max(lengths) <= 64
    assert dm.max_history_len_seen == max(lengths)


def test_stride_replaces_the_session_split(synth: InteractionLog) -> None:
    dm = RecDataModule(synth, **{**KW, "stride": 50}, num_val_visits=1, num_test_visits=1)
    starts = {n for b in dm.test_dataloader() for n in b.history_lengths.tolist()}
    assert starts and all(n % 50 == 0 for n in starts)


def test_named_sources(monkeypatch: pytest.MonkeyPatch, synth: InteractionLog) -> None:
    calls = []

    def fake_load(**kwargs: object) -> InteractionLog:
        calls.append(kwargs)
        return synth

    monkeypatch.setattr(datamodule_mod, "load_movielens_1m", fake_load)
    dm = RecDataModule("ml-1m", source_kwargs={"use_cache": False}, **KW)
    assert dm.num_items == synth.num_items and calls == [{"use_cache": False}]
    syn = RecDataModule("synthetic", source_kwargs={"num_users": 12, "max_len": 300, "num_items": 900}, **KW)
    assert (syn.log.num_users, syn.num_items) == (12, 900)
    assert int(syn.log.lengths.max()) <= 300
    with pytest.raises(ValueError, match="'ml-20m'"):
        RecDataModule("ml-20m")
    with pytest.raises(ValueError, match="max_next=40 exceeds num_candidates=32"):
        RecDataModule(synth, **{**KW, "max_next": 40})


def test_ml1m_small(ml1m: InteractionLog) -> None:
    dm = RecDataModule(ml1m, batch_size=16, num_candidates=64, max_next=8, max_users=50)
    dm.setup("fit")
    assert dm.num_items == 3706
    train, val = _first(dm.train_dataloader()), _first(dm.val_dataloader())
    assert int(train.candidate_items.max()) <= 3706 and int(val.candidate_items.max()) <= 3706
    assert set(val.user_ids.tolist()) <= set(range(1, 51))


class _Probe(lightning.LightningModule):
    """Counts validation batches; checks Lightning hands over a RequestBatch intact."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def validation_step(self, batch: RequestBatch, batch_idx: int) -> None:
        assert isinstance(batch, RequestBatch)
        assert batch.history_items.numel() == int(batch.history_lengths.sum())
        self.seen += batch.batch_size


def test_lightning_validate(dm: RecDataModule) -> None:
    probe = _Probe()
    trainer = lightning.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=3,
    )
    trainer.validate(probe, datamodule=dm, verbose=False)
    assert probe.seen == sum(b.batch_size for _, b in zip(range(3), dm.val_dataloader()))


def test_fewer_interleaved_users_than_a_batch_is_warned_about(synth: InteractionLog, caplog) -> None:
    with caplog.at_level("WARNING", logger="gr_plugin.data.datamodule"):
        RecDataModule(synth, **{**KW, "interleave_users": 4})
    assert "interleave_users=4 < batch_size=8" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gr_plugin.data.datamodule"):
        RecDataModule(synth, **{**KW, "interleave_users": 8})
    assert "interleave_users" not in caplog.text
