"""The unified stream (data/stream/loader.py, data/stream/reader.py): splitting, mixing, bad data, exact resume."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from omniloom.data.config import DataConfig, SourceConfig, check_visual_budget
from omniloom.data.stream.reader import SampleReader, resolve_source
from omniloom.data.stream.loader import WorkerStream, build_loader
from omniloom.data.stream.stream_bench import SyntheticTokenizer, synthetic_documents, write_shards

TOK = SyntheticTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two shard sets: 'a' with 3 uneven shards (odd count), 'b' with 2."""
    root = tmp_path_factory.mktemp("corpus")
    a = write_shards(str(root / "a"), synthetic_documents(45, seed=1, mean_text=120), name="a",
                     docs_per_shard=[20, 14, 11])
    b = write_shards(str(root / "b"), synthetic_documents(24, seed=2, mean_text=120), name="b",
                     docs_per_shard=[12, 12])
    return a, b


def _cfg(sources, **kw):
    base = dict(seq_len=256, batch_size=2, num_workers=2, shuffle_buffer=6, pack_buffer=6, seed=5)
    base.update(kw)
    return DataConfig(sources=[SourceConfig(path=p, weight=w) for p, w in sources], **base)


def _digests(loader, n):
    out = []
    for batch in loader:
        batch.validate()
        out.append(batch.digest())
        if len(out) == n:
            break
    return out


def test_restore_mid_epoch_gives_identical_batches_with_two_workers(corpus):
    a, b = corpus
    cfg = _cfg([(a, 2.0), (b, 1.0)])
    full = _digests(build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim), 9)
    first = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim)
    head = _digests(first, 5)  # odd: the next batch is due from worker 1, not worker 0
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert all(w["shuffle"] and w["packer"] for w in state["workers"]), "buffers must be non-empty mid-epoch"
    resumed = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim)
    resumed.load_state_dict(state)
    assert head + _digests(resumed, 4) == full
    assert len(set(full)) == len(full)


def test_restore_refuses_another_config_or_a_partial_pool(corpus):
    a, _ = corpus
    loader = build_loader(_cfg([(a, 1.0)]), TOK, patch_dim=TOK.tubelet_dim)
    _digests(loader, 1)
    state = loader.state_dict()
    # another layout is accepted (tests/data/test_stream_elastic.py), but needs every saved rank's state
    rank0 = build_loader(_cfg([(a, 1.0)]), TOK, patch_dim=TOK.tubelet_dim, rank=0, world_size=2)
    _digests(rank0, 1)
    with pytest.raises(ValueError, match="world_size=2 x num_workers=2.*every saved rank"):
        build_loader(_cfg([(a, 1.0)], num_workers=1), TOK, patch_dim=TOK.tubelet_dim).load_state_dict(rank0.state_dict())
    with pytest.raises(ValueError, match="seq_len"):
        build_loader(_cfg([(a, 1.0)], seq_len=128), TOK, patch_dim=TOK.tubelet_dim).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 0 given to rank 1"):
        build_loader(_cfg([(a, 1.0)]), TOK, patch_dim=TOK.tubelet_dim, rank=1,
                     world_size=1 + 1).load_state_dict({**state, "fingerprint": {**state["fingerprint"],
                                                                                  "world_size": 2}})


def test_slots_partition_every_epoch_with_an_odd_shard_count(corpus):
    """4 slots (2 ranks x 2 workers) over 3 uneven shards: each sample once per epoch, ranges +-1."""
    a, _ = corpus
    cfg = _cfg([(a, 1.0)])
    sets = [resolve_source(SourceConfig(path=a))]
    for epoch in (0, 1):
        seen, sizes = [], []
        for slot in range(4):
            cur = WorkerStream(sets, cfg, TOK, slot=slot, num_slots=4, pad_id=0, patch_dim=24).cursors[0]
            sizes.append(cur.range_len)
            seen += [cur.locate(epoch, p) for p in range(cur.range_len)]
        assert sorted(seen) == sorted((s, i) for s, n in enumerate([20, 14, 11]) for i in range(n))
        assert max(sizes) - min(sizes) <= 1
    orders = [WorkerStream(sets, cfg, TOK, slot=0, num_slots=4, pad_id=0, patch_dim=24).cursors[0]._plan(e)[0]
              for e in range(4)]
    assert len({tuple(o) for o in orders}) > 1, "shard order must be reshuffled per epoch"


def test_equal_batch_counts_per_rank_across_epoch_ends(corpus):
    a, _ = corpus
    cfg = _cfg([(a, 1.0)], num_workers=0, batch_size=1)
    counts, epochs = [], []
    for rank in range(2):
        loader = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim, rank=rank, world_size=2, max_batches=60)
        counts.append(len(_digests(loader, 10_000)))
        epochs.append(loader.epochs()[a])
    assert counts == [60, 60] and min(epochs) >= 1, "both ranks ran past an epoch end and kept pace"


def test_mixture_weights_are_respected(corpus):
    a, b = corpus
    sets = [resolve_source(SourceConfig(path=a, weight=3.0)), resolve_source(SourceConfig(path=b, weight=1.0))]
    stream = WorkerStream(sets, _cfg([(a, 3.0), (b, 1.0)]), TOK, slot=0, num_slots=1, pad_id=0, patch_dim=24)
    n = 2000
    from_a = sum(stream._draw_sample()[0][0] == 0 for _ in range(n))
    assert abs(from_a / n - 0.75) < 0.035  # ~3.6 sigma of a binomial(2000, 0.75)


def _corrupt_copy(src: str, dst: str) -> None:
    """Copy a shard set, then break it: garbage doc.json in one sample, bad media in another,
    the last shard truncated in the middle of its last sample."""
    import shutil

    shutil.copytree(src, dst)
    manifest = json.load(open(os.path.join(dst, "manifest.json")))
    first = manifest["shards"][0]
    path = os.path.join(dst, first["name"])
    raw = bytearray(open(path, "rb").read())
    body = first["samples"][1]["offset"] + 512  # first member (doc.json) data of sample 1
    raw[body:body + 8] = b"\x00garbage"
    reader = SampleReader(resolve_source(SourceConfig(path=src)).shards)
    for i in range(2, first["num_samples"]):
        doc, media = reader.read_document(0, i)
        if media:  # overwrite the synthetic header of this sample's first media member
            pos = raw.find(next(iter(media.values()))[:9], first["samples"][i]["offset"])
            raw[pos:pos + 3] = b"BAD"
            break
    open(path, "wb").write(bytes(raw))
    last = manifest["shards"][-1]
    path = os.path.join(dst, last["name"])
    os.truncate(path, last["samples"][-1]["offset"] + 700)


def test_bad_data_is_skipped_and_counted(corpus, tmp_path):
    a, _ = corpus
    bad = str(tmp_path / "bad")
    _corrupt_copy(a, bad)
    loader = build_loader(_cfg([(bad, 1.0)], num_workers=0, batch_size=4), TOK, patch_dim=TOK.tubelet_dim,
                          max_batches=30)  # past one epoch: every sample was tried
    assert len(_digests(loader, 100)) == 30
    assert loader.epochs()[bad] >= 1
    skipped = loader.skipped()
    assert skipped.get("bad_doc_json", 0) >= 1, skipped
    assert skipped.get("undecodable", 0) >= 1, skipped
    assert skipped.get("truncated_shard", 0) + skipped.get("corrupt_tar", 0) >= 1, skipped
    m = loader.metrics()
    assert m["skipped_total"] == sum(skipped.values())
    for key in ("samples_per_s", "tokens_per_s", "padding_fraction", "token_share/text", "token_share/image"):
        assert key in m
    assert 0 <= m["padding_fraction"] < 0.5 and abs(sum(v for k, v in m.items() if k.startswith("token_share")) - 1) < 1e-6


def test_errors_at_start(corpus, tmp_path):
    a, _ = corpus
    with pytest.raises(ValueError, match="sources is empty"):
        build_loader(DataConfig(), TOK, patch_dim=24)
    missing = str(tmp_path / "missing")
    import shutil

    shutil.copytree(a, missing)
    os.remove(os.path.join(missing, "a-000001.tar"))
    with pytest.raises(FileNotFoundError, match="a-000001.tar"):
        build_loader(_cfg([(missing, 1.0)]), TOK, patch_dim=24)
    empty = write_shards(str(tmp_path / "empty"), iter(()), name="e")
    with pytest.raises(ValueError, match="zero samples"):
        build_loader(_cfg([(empty, 1.0)]), TOK, patch_dim=24)
    with pytest.raises(FileNotFoundError, match="manifest"):
        build_loader(_cfg([(str(tmp_path), 1.0)]), TOK, patch_dim=24)
    man_path = os.path.join(missing, "manifest.json")
    for text, match in (("{not json", "not valid JSON"), ('{"format": "other"}', "not an omniloom shard manifest"),
                        ('{"format": "omniloom-shards", "version": 9}', "version 9")):
        with open(man_path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=match):
            build_loader(_cfg([(missing, 1.0)]), TOK, patch_dim=24)
    with pytest.raises(ValueError, match="weight"):
        SourceConfig(path=a, weight=0)


def test_brace_pattern_and_explicit_manifest(corpus):
    a, _ = corpus
    by_pattern = resolve_source(SourceConfig(path=os.path.join(a, "a-{000000..000001}.tar")))
    assert [s.name for s in by_pattern.shards] == ["a-000000.tar", "a-000001.tar"]
    assert by_pattern.num_samples == 34
    pipe = resolve_source(SourceConfig(path=f"pipe:cat {a}/a-000002.tar", manifest=os.path.join(a, "manifest.json")))
    assert pipe.num_samples == 11
    # a command whose last word is not the shard name still finds its manifest entry
    piped = resolve_source(SourceConfig(path=f"pipe:cat {a}/a-000002.tar | cat", manifest=os.path.join(a, "manifest.json")))
    assert [s.name for s in piped.shards] == ["a-000002.tar"] and piped.num_samples == 11
    doc, media = SampleReader(pipe.shards).read_document(0, 3)  # streamed, skipping to the offset
    local = SampleReader(resolve_source(SourceConfig(path=a)).shards).read_document(2, 3)
    assert (doc, media) == local
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        indexed = resolve_source(SourceConfig(path=f"pipe:cat {a}/a-000002.tar"))
    assert indexed.shards[0].offsets == pipe.shards[0].offsets


def test_visual_budget_warning():
    with pytest.warns(UserWarning, match="seq_len=256 cannot hold the largest video block"):
        check_visual_budget(256, max_image_patches=200, max_video_patches=512)
    assert check_visual_budget(4096, max_image_patches=256, max_video_patches=1024) == []


def test_visual_budget_warning_agrees_with_the_packer():
    """The warning fires exactly when split_document would refuse the largest block."""
    from omniloom.data.packing import PackingError, split_document

    doc = TOK({"segments": [{"type": "text", "text": "ab"}, {"type": "image", "ref": "i"},
                            {"type": "text", "text": "cd"}]}, {"i": b"SYNIMG" + bytes((1, 4, 5)) + b"x" * 20})
    for seq_len in range(18, 26):
        try:
            split_document(doc, seq_len)
            fits = True
        except PackingError:
            fits = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warned = bool(check_visual_budget(seq_len, max_image_patches=20))
        assert warned == (not fits), f"seq_len={seq_len}: warned={warned} but fits={fits}"


def _always_fails(doc, media):
    raise ValueError("no")


def test_a_stream_with_no_usable_document_stops_with_a_clear_error(corpus):
    a, _ = corpus
    loader = build_loader(_cfg([(a, 1.0)], num_workers=0), _always_fails, patch_dim=24)
    with pytest.raises(RuntimeError, match="could not be tokenized"):
        next(iter(loader))


def test_eval_split_is_a_finite_pass_that_repeats(corpus):
    a, b = corpus
    cfg = _cfg([(a, 1.0)], num_workers=0)
    cfg.eval_sources = [SourceConfig(path=b)]
    loader = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim, split="eval", max_batches=3)
    assert len(loader) == 3
    first, second = _digests(loader, 99), _digests(loader, 99)
    assert len(first) == 3 and first == second
    train = _digests(build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim, max_batches=3), 99)
    assert not set(first) & set(train)


@pytest.mark.gpu
def test_pinned_batches_move_to_cuda(corpus):

    a, _ = corpus
    loader = build_loader(_cfg([(a, 1.0)]), TOK, patch_dim=TOK.tubelet_dim, pin_memory=True, max_batches=2)
    for batch in loader:
        assert batch.input_ids.is_pinned() and batch.patches.is_pinned()
        on_gpu = batch.to("cuda", non_blocking=True)
        assert on_gpu.digest() == batch.digest() and on_gpu.patches.device.type == "cuda"


def test_http_shards_with_manifest_beside_them(corpus):
    """Shards on a web server (object-storage style): streamed with webdataset's gopen (curl)."""
    import functools
    import shutil
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    if shutil.which("curl") is None:
        pytest.skip("webdataset reads http:// through curl, which is not installed")
    a, _ = corpus
    handler = functools.partial(SimpleHTTPRequestHandler, directory=a)
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a-{{000000..000002}}.tar"
        remote = resolve_source(SourceConfig(path=url))
        local = resolve_source(SourceConfig(path=a))
        assert [s.offsets for s in remote.shards] == [s.offsets for s in local.shards]
        assert SampleReader(remote.shards).read_document(1, 5) == SampleReader(local.shards).read_document(1, 5)
    finally:
        server.shutdown()


def test_a_missing_source_folder_is_one_line_naming_it(tmp_path, capsys):
    """Issue 15.8: no 'indexing 1 shard(s) by a full read' warning, then a raw [Errno 2]."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the "no manifest found" warning must not come first
        with pytest.raises(FileNotFoundError, match=r"source '.*nowhere/shards': no such folder or shard file; point data.sources"):
            resolve_source(SourceConfig(path=str(tmp_path / "nowhere" / "shards")))
        with pytest.raises(FileNotFoundError, match=r"2 of 2 shards do not exist, e.g. '.*x-000\.tar'"):
            resolve_source(SourceConfig(path=str(tmp_path / "x-{000..001}.tar")))
    from omniloom.pretrain.cli import main
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path / "tok")
    assert main(["-qq", "train", "--run-dir", str(tmp_path / "run"), "tiny", f"data.sources=[{{path: {tmp_path / 'gone'}}}]",
                 f"data.tokenizer={tmp_path / 'tok'}", "train.num_steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gone': no such folder" in err and "Errno" not in err
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def test_visual_budget_is_one_plain_log_line_per_process(tmp_path, caplog):
    """Issue 15.2: not a UserWarning with a source line on every run (and every evaluation)."""
    import logging

    from omniloom.data.stream import loader as S
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path / "tok", video_patch_budget=8, video_frame_budget=16, temporal_patch_size=2)  # 64 + 2
    shards = tmp_path / "shards"
    write_shards(str(shards), synthetic_documents(6, seed=0), docs_per_shard=6)
    cfg = DataConfig(sources=[SourceConfig(path=str(shards))], tokenizer=str(tmp_path / "tok"), seq_len=48,
                     batch_size=1, num_workers=0)
    S._BUDGET_LOGGED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.INFO, logger="omniloom.data.stream"):
            for _ in range(3):
                build_loader(cfg, rank=0)
            build_loader(cfg, rank=1, world_size=2)
    lines = [r for r in caplog.records if "data.seq_len=48" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    assert "largest video block (66 tokens)" in msg and "set data.seq_len=66 or more" in msg and "--video-frame-budget" in msg


def _run(loader, n):
    """n batches' digests, then the loader's state and metrics."""
    digests = _digests(loader, n)
    return digests, loader.state_dict(), loader.metrics()


@pytest.mark.parametrize("cache_mb", [64, 0.02])  # everything fits / the budget fills early
def test_doc_cache_yields_the_uncached_batches_and_counters(corpus, tmp_path, cache_mb):
    """Over several epochs of a corpus with bad samples (unreadable ones, undecodable media, a
    truncated shard), the cached stream yields the same batches, worker states (skip counts,
    tokenizer stats, documents) and resume points as the uncached one, while most draws of the
    later epochs come from the cache."""
    a, b = corpus
    bad = str(tmp_path / "bad")
    _corrupt_copy(a, bad)
    sources = [(bad, 2.0), (b, 1.0)]
    n = 120  # several epochs of each source per worker
    plain, plain_state, _ = _run(build_loader(_cfg(sources), TOK, patch_dim=TOK.tubelet_dim), n)
    cached_loader = build_loader(_cfg(sources, doc_cache_mb=cache_mb), TOK, patch_dim=TOK.tubelet_dim)
    cached, cached_state, m = _run(cached_loader, n)
    assert cached == plain
    assert cached_state == plain_state
    assert min(st["cursors"][0][0] for st in plain_state["workers"]) >= 2, "the run must span several epochs"
    skipped = cached_loader.skipped()
    assert skipped.get("undecodable", 0) >= 2 and skipped.get("bad_doc_json", 0) >= 2, skipped  # replayed skips
    if cache_mb == 64:
        # not every draw after epoch 0 hits: each epoch shuffles the shard order, so a worker's
        # share of an epoch holds samples it has not read before
        assert m["doc_cache/full"] == 0 and m["doc_cache/hit_fraction"] > 0.3, m
    else:
        assert m["doc_cache/full"] == 1 and 0 < m["doc_cache/mb"] <= 2 * cache_mb, m  # a budget per worker
    # a resume mid-run (empty caches) continues with the uncached run's batches
    first = build_loader(_cfg(sources, doc_cache_mb=cache_mb), TOK, patch_dim=TOK.tubelet_dim)
    head = _digests(first, 67)
    resumed = build_loader(_cfg(sources, doc_cache_mb=cache_mb), TOK, patch_dim=TOK.tubelet_dim)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + _digests(resumed, n - 67) == plain


@pytest.mark.parametrize("rewrite", ["another-shard", "same-size"])
def test_doc_cache_drops_a_shard_rewritten_during_the_run(corpus, tmp_path, rewrite):
    """Issue 39 item 4: a shard rewritten in place mid-run. The uncached stream reads the new bytes
    (and skips what no longer sits at its manifest offset); the cached one trained on the old
    documents from memory, and its batches differed. Now a shard's entries are dropped when its
    size, mtime or inode change: the same batches and skip counts either way."""
    import shutil

    a, _ = corpus
    runs = {}
    for cache_mb in (0, 64):
        folder = str(tmp_path / f"a{cache_mb}")
        shutil.copytree(a, folder)
        loader = build_loader(_cfg([(folder, 1.0)], num_workers=0, doc_cache_mb=cache_mb), TOK, patch_dim=TOK.tubelet_dim)
        it = iter(loader)
        head = [next(it).digest() for _ in range(40)]
        assert loader.epochs()[folder] >= 1  # a whole epoch read: the cache holds the shard's documents
        path = os.path.join(folder, "a-000001.tar")
        if rewrite == "another-shard":  # another shard's bytes, written over it
            data = open(os.path.join(folder, "a-000000.tar"), "rb").read()
        else:  # the same size, other bytes: a doc.json of every sample garbled (only the mtime tells)
            data = bytearray(open(path, "rb").read())
            for smp in json.load(open(os.path.join(folder, "manifest.json")))["shards"][1]["samples"]:
                data[smp["offset"] + 512:smp["offset"] + 520] = b"\x00garbage"
        with open(path, "r+b") as f:  # in place: the same file, as a writer that rewrites it does
            f.write(bytes(data))
            f.truncate()
        tail = [next(it).digest() for _ in range(60)]
        runs[cache_mb] = (head, tail, loader.skipped(), loader.metrics())
        it.close()
    (head0, tail0, skipped0, _), (head1, tail1, skipped1, m) = runs[0], runs[64]
    assert head1 == head0 and skipped1 == skipped0 and tail1 == tail0
    assert sum(skipped0.values()) >= 10, skipped0  # the rewrite was seen: its samples are skipped
    assert m["doc_cache/hit_fraction"] > 0.3, m  # the other shards are still served from the cache


def test_doc_cache_is_off_by_default_and_for_evaluation(corpus):
    a, _ = corpus
    loader = build_loader(_cfg([(a, 1.0)], num_workers=0), TOK, patch_dim=TOK.tubelet_dim)
    _digests(loader, 3)
    assert not any(k.startswith("doc_cache/") for k in loader.metrics())
    ev = _cfg([(a, 1.0)], num_workers=0, doc_cache_mb=64)
    ev.eval_sources = ev.sources
    loader = build_loader(ev, TOK, patch_dim=TOK.tubelet_dim, split="eval", max_batches=3)
    _digests(loader, 3)
    assert not any(k.startswith("doc_cache/") for k in loader.metrics())
    with pytest.raises(ValueError, match="doc_cache_mb"):
        _cfg([(a, 1.0)], doc_cache_mb=-1)


@pytest.mark.parametrize("value", ["1e-300", "0.0005"])
def test_a_cache_budget_below_one_kib_is_refused_where_the_config_is_read(value, tmp_path, capsys):
    """Issue 39 item 9: data.doc_cache_mb=1e-300 rounds to a budget of 0 bytes; with loader workers
    each worker failed with its whole traceback. Now the config refuses it in one line, before
    any worker starts (and before the run folder is touched)."""
    from omniloom.pretrain.cli import main

    with pytest.raises(ValueError, match=rf"data.doc_cache_mb={value} is below the smallest cache, 1 KiB"):
        DataConfig(sources=[SourceConfig(path="x")], doc_cache_mb=float(value), num_workers=2)
    DataConfig(sources=[SourceConfig(path="x")], doc_cache_mb=1 / 1024, num_workers=2)  # the smallest cache
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "tiny", f"data.doc_cache_mb={value}", "data.num_workers=2",
                 f"data.sources=[{{path: {tmp_path}}}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.doc_cache_mb" in err[0] and "use 0 to turn the cache off" in err[0], err
    assert not run.exists()


class _FailsOnceEach:
    """SyntheticTokenizer that raises an unexpected error (no `reason`) the first time it sees a document."""

    def __init__(self):
        self.seen = set()

    def __call__(self, doc, media):
        key = json.dumps(doc, sort_keys=True)
        if key not in self.seen:
            self.seen.add(key)
            raise RuntimeError("transient: too many open files")
        return TOK(doc, media)


def test_doc_cache_retries_an_unexpected_tokenizer_error(corpus):
    """Only data errors (with a reason) are remembered; a transient error is tried again next time."""
    a, _ = corpus
    tok = _FailsOnceEach()
    loader = build_loader(_cfg([(a, 1.0)], num_workers=0, doc_cache_mb=64), tok, patch_dim=TOK.tubelet_dim)
    _digests(loader, 60)
    assert loader.epochs()[a] >= 2
    assert loader.skipped().get("RuntimeError") == len(tok.seen), (loader.skipped(), len(tok.seen))
    assert loader.metrics()["doc_cache/hit_fraction"] > 0.1  # the retried documents are cached once tokenized
