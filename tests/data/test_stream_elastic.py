"""Elastic data resume (data/stream/elastic.py): a state saved on one layout (ranks x workers) continues
on another with every document of an epoch trained on exactly once. Ranks are simulated in one
process, one StreamLoader each, consumed in lockstep like DDP steps."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.stream.cursor import slot_range
from omniloom.data.stream.elastic import redistribute, split
from omniloom.data.stream.loader import build_loader
from omniloom.data.stream.stream_bench import SyntheticTokenizer, synthetic_documents, write_shards

TOK = SyntheticTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources: 'a' with 3 uneven shards, 'b' with 2."""
    root = tmp_path_factory.mktemp("elastic")
    a = write_shards(str(root / "a"), synthetic_documents(45, seed=1, mean_text=120), name="a",
                     docs_per_shard=[20, 14, 11])
    b = write_shards(str(root / "b"), synthetic_documents(24, seed=2, mean_text=120), name="b",
                     docs_per_shard=[12, 12])
    return a, b


def _cfg(corpus, num_workers):
    a, b = corpus
    return DataConfig(sources=[SourceConfig(path=a, weight=2.0), SourceConfig(path=b, weight=1.0)], seq_len=256,
                      batch_size=2, num_workers=num_workers, shuffle_buffer=6, pack_buffer=6, seed=5)


def _loaders(corpus, world, workers, states=None):
    loaders = [build_loader(_cfg(corpus, workers), TOK, patch_dim=TOK.tubelet_dim, rank=r, world_size=world)
               for r in range(world)]
    if states is not None:
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(states)))  # as if from disk
    return loaders


def _steps(loaders, n, trained):
    """n lockstep steps; each piece trained on is appended to `trained`. Returns every rank's state
    as of the last step (the batches the workers prefetched beyond it are lost, as in a kill)."""
    its = [iter(loader) for loader in loaders]
    for _ in range(n):
        for loader, it in zip(loaders, its):
            next(it)
            trained += [(tuple(ref), idx) for ref, idx in loader.last_pieces]
    for it in its:
        it.close()  # shuts the workers down
    return [loader.state_dict() for loader in loaders]


def _epoch0_done(states, trained, sizes):
    """Every sample of epoch 0 was drawn, trained on, and none is still buffered anywhere."""
    seen = {(ref[0], ref[2]) for ref, _ in trained if ref[1] == 0}
    if len(seen) < sum(sizes):
        return False
    for st in states:
        for ws in st["workers"]:
            buffered = [ref for ref in ws["shuffle"]] + [ref for ref, _ in ws["packer"]]
            if ws is None or any(c[0] == 0 for c in ws["cursors"]) or any(ref[1] == 0 for ref in buffered):
                return False
    return True


def _check_exactly_once(corpus, trained):
    """No piece twice, in any epoch; every document of epoch 0 of every source, pieces 0..k-1."""
    counts = Counter(trained)
    assert max(counts.values()) == 1, [p for p, c in counts.items() if c > 1][:5]
    pieces: dict[tuple, list[int]] = {}
    for ref, idx in trained:
        pieces.setdefault(ref, []).append(idx)
    loader = build_loader(_cfg(corpus, 1), TOK, patch_dim=TOK.tubelet_dim)
    from omniloom.data.stream.loader import WorkerStream

    stream = WorkerStream(loader.sets, loader.cfg, TOK, slot=0, num_slots=1, pad_id=0, patch_dim=TOK.tubelet_dim)
    for src, s in enumerate(loader.sets):
        refs = [ref for ref in pieces if ref[0] == src and ref[1] == 0]
        assert sorted(ref[2] for ref in refs) == list(range(s.num_samples)), f"source {src}: a document lost"
        ids = {stream.cursors[src].read(0, ref[2])[0]["meta"]["source"] for ref in refs}
        assert len(ids) == s.num_samples  # the documents themselves, by id: all distinct, all there
        for ref in refs:
            assert sorted(pieces[ref]) == list(range(len(pieces[ref]))), f"{ref}: a piece lost"
    stream.close()


def _run_to_epoch_end(corpus, layouts, cuts):
    """Start on layouts[0]; after cuts[i] steps, 'kill' and resume on layouts[i + 1]; then run
    until epoch 0 is fully trained. Returns the pieces trained on, in order."""
    trained: list = []
    loaders = _loaders(corpus, *layouts[0])
    for cut, old, layout in zip(cuts, layouts, layouts[1:]):
        states = _steps(loaders, cut, trained)
        loaders = _loaders(corpus, *layout, states=states)
        assert all(loader.resumed_from == old for loader in loaders)
    sizes = [s.num_samples for s in loaders[0].sets]
    for _ in range(60):
        states = _steps(loaders, 4, trained)
        if _epoch0_done(states, trained, sizes):
            return trained
        loaders = _loaders(corpus, *layouts[-1], states=states)  # same layout: exact resume
    raise AssertionError("epoch 0 never finished")


@pytest.mark.parametrize("new_layout", [(1, 1), (4, 1)])
@pytest.mark.parametrize("cut", [1, 4, 7])
def test_two_by_two_resumed_on_another_layout_trains_each_document_once(corpus, new_layout, cut):
    trained = _run_to_epoch_end(corpus, [(2, 2), new_layout], [cut])
    _check_exactly_once(corpus, trained)


def test_a_chain_of_layout_changes_keeps_exactly_once(corpus):
    trained = _run_to_epoch_end(corpus, [(2, 2), (1, 1), (4, 1), (2, 2), (3, 1)], [3, 2, 3, 2])
    _check_exactly_once(corpus, trained)


def test_unchanged_layout_after_an_elastic_resume_is_exact(corpus, caplog):
    loaders = _loaders(corpus, 2, 2)
    states = _steps(loaders, 5, [])
    with caplog.at_level("INFO", logger="omniloom.data.stream"):
        one = _loaders(corpus, 1, 1, states=states)[0]
    lines = [r.getMessage() for r in caplog.records if "another layout" in r.getMessage()]
    assert len(lines) == 1 and "2 rank(s) x 2 worker(s) -> 1 rank(s) x 1 worker(s)" in lines[0]
    assert one.resumed_from == (2, 2)
    head = _steps([one], 3, [])
    assert head[0]["workers"][0].get("pending"), "the redistributed epoch is still in progress"
    full = [b.digest() for b, _ in zip(one, range(4))]
    again = _loaders(corpus, 1, 1, states=head)[0]
    assert again.resumed_from is None
    assert [b.digest() for b, _ in zip(again, range(4))] == full


def test_version_1_states_are_upgraded(corpus):
    """A state written before references were global (version 1) resumes exactly as before."""
    loaders = _loaders(corpus, 1, 2)
    state = _steps(loaders, 3, [])[0]
    expected = [b.digest() for b, _ in zip(_loaders(corpus, 1, 2, states=state)[0], range(3))]
    old = json.loads(json.dumps(state))
    old["version"] = 1
    sizes = [s.num_samples for s in loaders[0].sets]
    for w, ws in enumerate(old["workers"]):
        def rel(ref, w=w):
            return [ref[0], ref[1], ref[2] - slot_range(sizes[ref[0]], w, 2)[0]]
        ws["shuffle"] = [rel(r) for r in ws["shuffle"]]
        ws["packer"] = [[rel(r), i] for r, i in ws["packer"]]
    assert [b.digest() for b, _ in zip(_loaders(corpus, 1, 2, states=old)[0], range(3))] == expected


def test_split_and_redistribute_partition_the_unread_rest():
    assert split([(0, 3), (10, 12)], 2) == [[(0, 2)], [(2, 3), (10, 12)]]
    assert split([(0, 2)], 3) == [[], [(0, 1)], [(1, 2)]]
    fp = {"world_size": 2, "num_workers": 1, "sources": [["s", 1.0, 10]]}
    states = [{"rank": r, "consumed": 1, "fingerprint": fp,
               "workers": [{"cursors": [[0, 3]], "shuffle": [[0, 0, 5 * r]], "packer": [[[0, 0, 5 * r + 1], 0]],
                            "skipped": {"x": 1}, "token_stats": {}, "docs": 2, "batches": 1}]} for r in range(2)]
    new = [ws for row in redistribute(states, num_samples=[10], seed=0, world_size=3, num_workers=1) for ws in row]
    # unread: [3, 5) and [8, 10) -> 4 samples over 3 slots
    assert [ws["pending"][0] for ws in new] == [[[0, [[3, 4]]]], [[0, [[4, 5]]]], [[0, [[8, 10]]]]]
    assert sorted(ref for ws in new for ref in ws["shuffle"]) == [[0, 0, 0], [0, 0, 5]]
    assert sum(len(ws["packer"]) for ws in new) == 2
    assert sum(ws["skipped"].get("x", 0) for ws in new) == 2


def test_another_layout_with_another_data_config_is_still_refused(corpus):
    states = [loader.state_dict() for loader in _loaders(corpus, 2, 2)]
    other = build_loader(DataConfig(**{**_cfg(corpus, 1).__dict__, "seq_len": 128}), TOK, patch_dim=TOK.tubelet_dim)
    with pytest.raises(ValueError, match="does not match this data config.*seq_len: saved 256, now 128"):
        other.load_state_dict(states)
