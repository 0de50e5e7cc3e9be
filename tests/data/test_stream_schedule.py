"""Source schedules (data/stream/schedule.py): a source drawn from a training step on or before one,
a modality filter, and the text-first start they write (`data.text_first_steps`). The stream
draws no visual document before the switch step, on any layout, and resumes across the switch
exactly (same layout) or with every document once (another layout)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from omniloom.data.config import DataConfig, SourceConfig, text_first_sources
from omniloom.data.stream.loader import WorkerStream, build_loader
from omniloom.data.stream.schedule import SourceSchedule, StepClock
from omniloom.data.stream.state_check import LoaderStateError, check_loader_state
from omniloom.data.stream.stream_bench import SyntheticTokenizer, synthetic_documents, write_shards

TOK = SyntheticTokenizer()
VISUAL = (2, 3)  # PackedBatch.modality of image and video tokens


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """60 documents in 3 shards, about a third with an image or a video."""
    root = tmp_path_factory.mktemp("schedule")
    return write_shards(str(root / "a"), synthetic_documents(60, seed=3, mean_text=100), name="a", docs_per_shard=[25, 20, 15])


def _cfg(shards, workers=0, switch=6, **kw):
    return DataConfig(sources=[SourceConfig(path=shards)], text_first_steps=switch, seq_len=256, batch_size=2,
                      num_workers=workers, shuffle_buffer=4, pack_buffer=4, seed=1, **kw)


def _loader(shards, world=1, rank=0, accum=2, states=None, **kw):
    loader = build_loader(_cfg(shards, **kw), TOK, patch_dim=TOK.tubelet_dim, rank=rank, world_size=world,
                          batches_per_step=accum)
    if states is not None:
        loader.load_state_dict(json.loads(json.dumps(states)))  # as if from disk
    return loader


def _take(loaders, n):
    """n lockstep batches per rank: [(rank, step, visual tokens, pieces)], and the states after."""
    out, its = [], [iter(ld) for ld in loaders]
    for _ in range(n):
        for r, (ld, it) in enumerate(zip(loaders, its)):
            step = ld.step
            batch = next(it)
            visual = int(sum((batch.modality == m).sum() for m in VISUAL))
            out.append((r, step, visual, [(tuple(ref), i) for ref, i in ld.last_pieces]))
    for it in its:
        it.close()
    return out, [ld.state_dict() for ld in loaders]


def _visual_docs(shards) -> set[int]:
    """Global indices (epoch 0 order) of the documents with an image or video."""
    ld = build_loader(DataConfig(sources=[SourceConfig(path=shards)], seq_len=256), TOK, patch_dim=TOK.tubelet_dim)
    stream = WorkerStream(ld.sets, ld.cfg, TOK, slot=0, num_slots=1, pad_id=0, patch_dim=TOK.tubelet_dim)
    out = {g for g in range(ld.sets[0].num_samples)
           if any(seg["type"] in ("image", "video") for seg in stream.cursors[0].read(0, g)[0]["segments"])}
    stream.close()
    return out


def test_text_first_expands_to_a_schedule_per_source():
    a, b = SourceConfig(path="a", weight=3), SourceConfig(path="b", name="bee")
    out = text_first_sources([a, b], 10)
    assert [(s.label, s.start_step, s.end_step, s.modalities, s.weight) for s in out] == [
        ("a [text+code]", 0, 10, ["text", "code"], 3), ("a", 10, 0, [], 3),
        ("bee [text+code]", 0, 10, ["text", "code"], 1), ("bee", 10, 0, [], 1)]
    with pytest.raises(ValueError, match="its own"):
        DataConfig(sources=[SourceConfig(path="a", start_step=0, end_step=4), b], text_first_steps=3)
    with pytest.raises(ValueError, match="no source is active at training step 4"):
        DataConfig(sources=[SourceConfig(path="a", end_step=4), SourceConfig(path="b", start_step=5)])
    with pytest.raises(ValueError, match="not segment types"):
        SourceConfig(path="a", modalities=["txt"])
    with pytest.raises(ValueError, match="evaluation"):
        DataConfig(sources=[a], eval_sources=[SourceConfig(path="h", start_step=2)])


def test_schedule_renormalizes_over_the_active_sources_and_the_clock_counts_steps():
    sched = SourceSchedule([SourceConfig(path="t", weight=1, end_step=5), SourceConfig(path="a", weight=3),
                            SourceConfig(path="v", weight=4, start_step=5)])
    p, active = sched.at(0)
    assert active == [0, 1] and p.tolist() == [0.25, 0.75, 0.0]
    p, active = sched.at(5)
    assert active == [1, 2] and p.tolist() == [0.0, 3 / 7, 4 / 7]
    assert sched.at(10**6)[1] == [1, 2]
    assert SourceSchedule([SourceConfig(path="a")]).fingerprint() is None  # unscheduled: the old fingerprint
    clock = StepClock(batches_per_step=3)
    assert [clock.step_of(b) for b in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    # resumed at batch 0 (another layout) from a state saved one batch into step 4: on with step 4
    again = clock.resumed(0, clock.position(13))
    assert [again.step_of(b) for b in range(3)] == [4, 4, 5]


def test_no_visual_document_before_the_switch(shards):
    switch, accum = 6, 2
    got, _ = _take([_loader(shards, accum=accum, switch=switch)], 30)
    before = [g for g in got if g[1] < switch]
    assert len(before) == switch * accum and [g[1] for g in got[:4]] == [0, 0, 1, 1]
    assert sum(g[2] for g in before) == 0, "an image or video token before the switch"
    visual = _visual_docs(shards)
    refs = [ref for g in before for ref, _ in g[3]]
    assert {ref[0] for ref in refs} == {0} and not {ref[2] for ref in refs if ref[1] == 0} & visual
    after = [g for g in got if g[1] >= switch]
    assert sum(g[2] for g in after) > 0, "the full mix never came"
    # the copy is drawn no more after the switch, and what it drew but had not trained on is
    # dropped at the switch (its documents are the full source's too): from the switch on, every
    # piece is the full source's, so the mix changes at once, not after the buffers drain
    first_full = min(i for i, g in enumerate(got) if any(ref[0] == 1 for ref, _ in g[3]))
    assert got[first_full][1] == switch
    assert all(ref[0] == 1 for g in after for ref, _ in g[3])


@pytest.mark.parametrize("workers, cut", [(0, 5), (2, 7)])
def test_resume_across_the_switch_is_exact(shards, workers, cut):
    """Stopped before the switch (mid-step too: cut 7 with 2 batches a step) and resumed: the same
    batches as an uninterrupted run, before and after the switch."""
    whole, _ = _take([_loader(shards, workers=workers)], 24)
    head, states = _take([_loader(shards, workers=workers)], cut)
    assert states[0]["step"] == [cut // 2, cut % 2] and "schedule" in states[0]["fingerprint"]
    tail, _ = _take([_loader(shards, workers=workers, states=states[0])], 24 - cut)
    assert [(g[1], g[3]) for g in head + tail] == [(g[1], g[3]) for g in whole]


def test_the_schedule_is_part_of_the_data_config_a_resume_checks(shards):
    _, states = _take([_loader(shards, switch=6)], 3)
    with pytest.raises(ValueError, match="schedule"):
        _loader(shards, switch=8, states=states[0])
    loader = build_loader(DataConfig(sources=[SourceConfig(path=shards)], seq_len=256, batch_size=2, num_workers=0,
                                     shuffle_buffer=4, pack_buffer=4, seed=1), TOK, patch_dim=TOK.tubelet_dim)
    with pytest.raises(ValueError, match="sources"):  # the text-first run has two sources, this one one
        loader.load_state_dict(states[0])
    bad = json.loads(json.dumps(states[0]))
    bad["step"] = [-1, 0]
    with pytest.raises(LoaderStateError, match="step"):
        check_loader_state(bad)
    bad = json.loads(json.dumps(states[0]))
    bad["fingerprint"]["schedule"] = [[0, 6, ["text"]]]
    with pytest.raises(LoaderStateError, match="schedule"):
        check_loader_state(bad)


def test_elastic_resume_before_the_switch_trains_each_text_document_once(shards):
    """2 ranks cut before the switch, resumed on 1: no visual token before the switch on either
    layout, no piece twice, and every text-only document of the copy's epoch 0 trained once."""
    switch = 40
    trained, steps = [], []
    got, states = _take([_loader(shards, world=2, rank=r, accum=1, switch=switch) for r in range(2)], 3)
    one = _loader(shards, accum=1, switch=switch, states=states)
    assert one.resumed_from == (2, 1) and one.step == 3
    more, _ = _take([one], 60)
    for g in got + more:
        steps.append(g[1])
        trained += g[3]
        assert g[1] >= switch or g[2] == 0, "a visual token before the switch"
    assert max(Counter(trained).values()) == 1, "a piece trained twice"
    text0 = {ref[2] for ref, _ in trained if ref[0] == 0 and ref[1] == 0}
    assert text0 == set(range(60)) - _visual_docs(shards), "a text document lost, or a visual one drawn"
    assert any(ref[0] == 1 for ref, _ in trained) and min(s for s, g in zip(steps, got + more) if any(r[0] == 1 for r, _ in g[3])) >= switch


def test_the_doc_cache_gives_the_same_filtered_batches(shards):
    plain, _ = _take([_loader(shards)], 30)
    cached, _ = _take([_loader(shards, doc_cache_mb=8)], 30)
    assert [g[3] for g in plain] == [g[3] for g in cached]


def test_a_text_only_source_skips_visual_documents_counted(shards):
    cfg = DataConfig(sources=[SourceConfig(path=shards, modalities=["text", "code"])], seq_len=256, batch_size=2,
                     num_workers=0, shuffle_buffer=4, pack_buffer=4)
    loader = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim)
    for batch, _ in zip(loader, range(12)):
        assert not torch.isin(batch.modality, torch.tensor(VISUAL, dtype=batch.modality.dtype)).any()
    assert loader.skipped().get("outside_modalities", 0) > 0


def test_a_text_first_source_without_text_documents_is_drawn_no_more(tmp_path, shards):
    """The demo's synthetic set has no document without an image or video: under text-first its
    copy is found barren (a warning), the other source's text feeds the steps before the switch,
    and the barren mark is part of the state (an exact resume draws as the uninterrupted run)."""
    visual = write_shards(str(tmp_path / "v"), (d for d in synthetic_documents(200, seed=4, image_frac=1.0)), name="v",
                          docs_per_shard=[10])
    def loader(states=None):
        cfg = DataConfig(sources=[SourceConfig(path=visual, weight=1000), SourceConfig(path=shards)], text_first_steps=5,
                         seq_len=256, batch_size=2, num_workers=0, shuffle_buffer=4, pack_buffer=4, seed=1)
        ld = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim)
        if states is not None:
            ld.load_state_dict(json.loads(json.dumps(states)))
        return ld
    whole, _ = _take([loader()], 12)
    assert all(g[2] == 0 for g in whole if g[1] < 5) and any(g[2] for g in whole)
    head, states = _take([loader()], 3)
    assert states[0]["workers"][0]["barren"] == [0]
    tail, _ = _take([loader(states[0])], 9)
    assert [g[3] for g in head + tail] == [g[3] for g in whole]
    bad = json.loads(json.dumps(states[0]))
    bad["workers"][0]["barren"] = [9]
    with pytest.raises(LoaderStateError, match="barren"):
        check_loader_state(bad)
