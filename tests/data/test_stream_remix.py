"""Issue 41 item 4: resuming the data stream on another mix of sources
(`load_state_dict(..., sources="keep_unchanged")`, data/stream/remix.py): the sources of the same
label and sample count continue where they were, even when their index moved, with each document
of the epoch trained on exactly once; new sources start at their beginning; weights change."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.stream.loader import WorkerStream, build_loader
from omniloom.data.stream.remix import plan
from omniloom.data.stream.stream_bench import SyntheticTokenizer, synthetic_documents, write_shards

TOK = SyntheticTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("remix")
    a = write_shards(str(root / "a"), synthetic_documents(45, seed=1, mean_text=120), name="a", docs_per_shard=[20, 14, 11])
    b = write_shards(str(root / "b"), synthetic_documents(24, seed=2, mean_text=120), name="b", docs_per_shard=[12, 12])
    c = write_shards(str(root / "c"), synthetic_documents(16, seed=3, mean_text=120), name="c", docs_per_shard=[9, 7])
    return {"a": a, "b": b, "c": c}


def _cfg(corpus, mix, workers):
    return DataConfig(sources=[SourceConfig(path=corpus[k], weight=w, name=k) for k, w in mix], seq_len=256,
                      batch_size=2, num_workers=workers, shuffle_buffer=6, pack_buffer=6, seed=5)


def _loaders(corpus, mix, world, workers, states=None, sources="exact"):
    loaders = [build_loader(_cfg(corpus, mix, workers), TOK, patch_dim=TOK.tubelet_dim, rank=r, world_size=world)
               for r in range(world)]
    if states is not None:
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(states)), sources=sources)
    return loaders


def _steps(loaders, n, trained, names):
    """n lockstep steps; each piece trained on is appended to `trained` as (source name, epoch, g, piece)."""
    its = [iter(loader) for loader in loaders]
    for _ in range(n):
        for loader, it in zip(loaders, its):
            next(it)
            trained += [(names[ref[0]], ref[1], ref[2], idx) for ref, idx in loader.last_pieces]
    for it in its:
        it.close()
    return [loader.state_dict() for loader in loaders]


def _epoch0_done(states) -> bool:
    """Every slot is past epoch 0 of every source and holds no epoch-0 document in its buffers."""
    for st in states:
        for ws in st["workers"]:
            if ws is None or any(c[0] == 0 for c in ws["cursors"]):
                return False
            if any(ref[1] == 0 for ref in ws["shuffle"]) or any(ref[1] == 0 for ref, _ in ws["packer"]):
                return False
    return True


def _doc_ids(corpus, mix, trained):
    """(source name, epoch, g) -> the document's own id, read under `mix`'s orders."""
    loader = build_loader(_cfg(corpus, mix, 1), TOK, patch_dim=TOK.tubelet_dim)
    stream = WorkerStream(loader.sets, loader.cfg, TOK, slot=0, num_slots=1, pad_id=0, patch_dim=TOK.tubelet_dim)
    index = {name: i for i, (name, _) in enumerate(mix)}
    out = {}
    for name, epoch, g, _ in trained:
        out[(name, epoch, g)] = stream.cursors[index[name]].read(epoch, g)[0]["meta"]["source"]
    stream.close()
    return out


def test_plan_keeps_sources_of_the_same_label_and_size():
    old = [["a", 2.0, 45], ["b", 1.0, 24], ["gone", 1.0, 5]]
    new = [["c", 1.0, 16], ["b", 3.0, 24], ["a", 1.0, 45], ["gone", 1.0, 6]]
    assert plan(old, new) == {0: 2, 1: 1}  # 'gone' changed size: it starts anew


def test_plan_keeps_a_source_only_with_the_same_shards_where_both_states_say():
    old = [["a", 1.0, 45, "x1"], ["b", 1.0, 24, "y1"], ["c", 1.0, 16]]
    new = [["a", 1.0, 45, "x2"], ["b", 1.0, 24, "y1"], ["c", 1.0, 16, "z1"]]
    assert plan(old, new) == {1: 1, 2: 2}  # a was re-sharded; c's saved state predates the digest


def test_a_resharded_source_is_named_on_exact_resume_and_starts_anew_with_keep_unchanged(corpus, tmp_path):
    """The same 45 documents of `a` rebuilt into other shards: same label, same sample count, but
    each epoch's order (a shuffle of its shards) names other documents at the saved positions."""
    docs = synthetic_documents(45, seed=1, mean_text=120)
    resharded = {**corpus, "a": write_shards(str(tmp_path / "a"), docs, name="a", docs_per_shard=[15, 15, 15])}
    mix = [("a", 2.0), ("b", 1.0)]
    states = _steps(_loaders(corpus, mix, 1, 1), 3, [], ["a", "b"])
    with pytest.raises(ValueError, match="source 'a' has other shards than when the state was saved"):
        _loaders(resharded, mix, 1, 1, states=states)
    (loader,) = _loaders(resharded, mix, 1, 1, states=states, sources="keep_unchanged")
    assert "continuing where they were: b;" in loader.remixed and "(new or changed): a;" in loader.remixed
    # a state saved before the digest (3 entries per source) still resumes exactly on unchanged shards
    old_style = json.loads(json.dumps(states))
    old_style[0]["fingerprint"]["sources"] = [e[:3] for e in old_style[0]["fingerprint"]["sources"]]
    (a,), (b,) = _loaders(corpus, mix, 1, 1, states=states), _loaders(corpus, mix, 1, 1, states=old_style)
    assert _steps([a], 2, [], ["a", "b"])[0]["workers"] == _steps([b], 2, [], ["a", "b"])[0]["workers"]


def test_a_barren_mark_moves_with_its_source_only_under_the_same_modality_filter(corpus):
    """A filtered source found to hold no document its modalities take is drawn no more; after a
    change of its filter it must be looked at again."""
    from omniloom.data.stream.remix import remap_states

    states = _steps(_loaders(corpus, [("a", 1.0), ("b", 1.0)], 1, 1), 2, [], ["a", "b"])
    states[0]["fingerprint"]["schedule"] = [[0, 0, ["text"]], [0, 0, []]]
    states[0]["workers"][0]["barren"] = [0]
    moved = build_loader(_cfg(corpus, [("c", 1.0), ("a", 1.0), ("b", 1.0)], 1), TOK, patch_dim=TOK.tubelet_dim)
    counts = [[sh.num_samples for sh in src.shards] for src in moved.sets]
    new = moved._fingerprint()["sources"]
    for filt, barren in ((["text"], [1]), (["code", "text"], [])):
        (out,) = remap_states(states, new, counts, 5, [[0, 0, []], [0, 0, filt], [0, 0, []]])
        assert out["workers"][0]["barren"] == barren, filt


def test_a_removed_source_drops_its_buffered_documents_counted(corpus):
    from omniloom.data.stream.remix import remap_states

    loaders = _loaders(corpus, [("a", 2.0), ("b", 1.0)], 1, 1)
    states = _steps(loaders, 3, [], ["a", "b"])
    ws = states[0]["workers"][0]
    held = sum(ref[0] == 1 for ref in ws["shuffle"]) + len({tuple(ref) for ref, _ in ws["packer"] if ref[0] == 1})
    assert held > 0  # b has documents buffered
    only_a = build_loader(_cfg(corpus, [("a", 1.0)], 1), TOK, patch_dim=TOK.tubelet_dim)
    (out,) = remap_states(states, only_a._fingerprint()["sources"], [[sh.num_samples for sh in only_a.sets[0].shards]], 5)
    got = out["workers"][0]
    assert got["skipped"].get("source_removed") == held
    assert all(ref[0] == 0 for ref in got["shuffle"]) and all(ref[0] == 0 for ref, _ in got["packer"])


@pytest.mark.parametrize("layout", [(1, 1), (2, 2)])
def test_a_moved_source_continues_exactly_and_a_new_one_starts(corpus, layout):
    before_mix, after_mix = [("a", 2.0), ("b", 1.0)], [("c", 1.0), ("b", 3.0), ("a", 1.0)]
    trained_before: list = []
    loaders = _loaders(corpus, before_mix, *layout)
    states = _steps(loaders, 5, trained_before, ["a", "b"])
    with pytest.raises(ValueError, match="data-loader state does not match"):
        _loaders(corpus, after_mix, *layout, states=states)  # the default stays exact
    loaders = _loaders(corpus, after_mix, *layout, states=states, sources="keep_unchanged")
    assert "continuing where they were: b, a" in loaders[0].remixed and "beginning (new or changed): c" in loaders[0].remixed
    trained_after: list = []
    for _ in range(60):
        states = _steps(loaders, 4, trained_after, ["c", "b", "a"])
        if _epoch0_done(states):
            break
        loaders = _loaders(corpus, after_mix, *layout, states=states)
    else:
        raise AssertionError("epoch 0 never finished")
    ids = {**_doc_ids(corpus, before_mix, trained_before), **{("after",) + k: v for k, v in _doc_ids(corpus, after_mix, trained_after).items()}}
    pieces = Counter()
    for when, trained in (((), trained_before), (("after",), trained_after)):
        for name, epoch, g, idx in trained:
            if epoch == 0:
                pieces[(name, ids[when + (name, epoch, g)], idx)] += 1
    assert max(pieces.values()) == 1, [k for k, v in pieces.items() if v > 1][:5]  # nothing repeated
    for name, n in (("a", 45), ("b", 24), ("c", 16)):
        docs = {doc for src, doc, _ in pieces if src == name}
        assert len(docs) == n, f"source {name}: {n - len(docs)} document(s) of epoch 0 lost"
    # the new source started at its beginning: none of its epoch-0 documents came before the change
    assert not any(p[0] == "c" for p in trained_before)
