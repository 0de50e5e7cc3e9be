"""The stream end to end on real parts: shards from `omniloom data build`, omniloom's tokenizer."""

from __future__ import annotations

import pytest

from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.stream.loader import build_loader
from omniloom.tokenizers.layout import IMAGE, VIDEO


@pytest.fixture(scope="module")
def real_parts(tmp_path_factory):
    from omniloom.data.prep.shards import build
    from omniloom.data.prep.synth import make_good_corpus
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("real")
    make_good_corpus(root / "raw", n_text=3, n_images=3, n_videos=1)
    build([str(root / "raw")], str(root / "shards"), name="real", shard_max_docs=4, progress=False)
    tok = make_tiny_tokenizer(root / "tok")
    return str(root / "shards"), str(root / "tok"), tok


def test_real_shards_and_tokenizer_give_valid_batches_and_resume(real_parts):
    shards, tok_dir, tok = real_parts
    cfg = DataConfig(sources=[SourceConfig(path=shards)], tokenizer=tok_dir, seq_len=256, batch_size=2,
                     num_workers=1, shuffle_buffer=4, pack_buffer=4, seed=3)
    loader = build_loader(cfg)  # the default tokenize_fn: the tokenizer in cfg.tokenizer
    assert loader.patch_dim == max(tok.patch_dim, tok.tubelet_dim) and loader.pad_id == tok.pad_id
    digests, kinds = [], set()
    for batch in loader:
        batch.validate()
        digests.append(batch.digest())
        kinds.update(batch.patch_kind.tolist())
        if len(digests) == 8:
            break
    assert kinds == {IMAGE, VIDEO}, "the corpus has images and a video"
    m = loader.metrics()
    assert m["token_share/image"] > 0 and m["token_share/code"] > 0
    state = loader.state_dict()
    again = build_loader(cfg)
    again.load_state_dict(state)
    nxt = next(iter(loader)).digest()
    assert next(iter(again)).digest() == nxt


@pytest.mark.parametrize("patch_dtype", ["float16", "bfloat16", "float32"])
def test_doc_cache_gives_the_uncached_batches_with_real_media(real_parts, patch_dtype):
    """Real decoded images and a video: cached pieces keep their patches in the dtype the batch
    stores them in, so batches (patches included) are bit-identical to the uncached stream's."""
    shards, tok_dir, _ = real_parts
    runs = []
    for cache_mb in (0, 16):
        cfg = DataConfig(sources=[SourceConfig(path=shards)], tokenizer=tok_dir, seq_len=256, batch_size=2,
                         num_workers=0, shuffle_buffer=2, pack_buffer=2, seed=3, patch_dtype=patch_dtype,
                         doc_cache_mb=cache_mb)
        loader = build_loader(cfg)
        digests, kinds = [], set()
        for batch in loader:
            digests.append(batch.digest())
            kinds.update(batch.patch_kind.tolist())
            if len(digests) == 12:
                break
        runs.append((digests, loader.state_dict(), loader.metrics()))
    (plain, plain_state, _), (cached, cached_state, m) = runs
    assert kinds == {IMAGE, VIDEO}
    assert cached == plain and cached_state == plain_state
    assert m["doc_cache/hit_fraction"] > 0.5, m
