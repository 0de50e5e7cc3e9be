"""`omniloom eval`: held-out loss and perplexity per modality, and the cross-modal gap.

Documents are read from shards in manifest order (all of them, or the first `max_docs`), tokenized with the model's own
tokenizer and scored one document per row (no packing, so nothing but the document is in
context; documents of one length share a forward, a row each); a document longer than `max_len`
(default: the run's seq_len) is scored in pieces cut the way training cuts it. Cross-entropy is attributed to the modality of the *target* token, as in training.

Cross-modal gap: for every document with a visual block, the text is scored twice, once with its
own image/video and once with every visual block replaced by one from another document of the same
kind (a donor with the same grid when one of the recent ones has it, else the donor's pixels
re-tokenized to this document's grid, so the token layout and positions stay identical). The gap is

    mean over text targets after the first visual block of  (loss with donor visual) - (loss with own)

in nats/token, reported separately for image documents and video documents (documents holding both
are reported as "mixed" in the details). Text before the first block cannot see it (causal), so it
is left out; a model that reads its visual tokens gets a positive gap, one that ignores them ~0.

Its uncertainty is over documents (`gap_interval`): the gap is a ratio of sums over documents (the
loss difference summed over each document's text targets, over the targets), so its standard
error is the ratio estimator's, from the per-document residuals, and the 95% interval is the gap
plus or minus Student's t (documents - 1 degrees of freedom) times it. A gap whose interval holds 0
is reported as not distinguishable from 0: a barely trained model's gap is mostly which donor
each document happened to get.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from omniloom.pretrain.runtime.threads import tuned

from .load import DEFAULT_CONTEXT

log = logging.getLogger(__name__)

MODALITY_NAMES = ("text", "code", "image", "video", "special")
TEXT, CODE, IMAGE, VIDEO = 0, 1, 2, 3
DONOR_POOL = 8  # recent visual blocks per kind kept as donors
# Documents of one length share a forward of at most min(EVAL_BATCH_TOKENS, max_len) tokens (so its
# logits are no larger than those of one document of max_len alone); the loop reads up to
# EVAL_CHUNK_DOCS documents or EVAL_CHUNK_TOKENS tokens ahead (their pixels held), then scores them.
EVAL_BATCH_TOKENS = 4096
EVAL_CHUNK_DOCS = 64
EVAL_CHUNK_TOKENS = 32768


@dataclass
class _Donor:
    doc_index: int
    kind: int
    grid: tuple[int, int, int]
    patches_ND: np.ndarray


class _Sums:
    """Sums of CE and counts per key."""

    def __init__(self):
        self.ce: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def add(self, key: str, ce_sum: float, count: int) -> None:
        self.ce[key] += ce_sum
        self.n[key] += count

    def mean(self, key: str) -> float | None:
        return self.ce[key] / self.n[key] if self.n.get(key) else None


def _resolve_sources(data: str | list[str]):
    from omniloom.data.config import SourceConfig
    from omniloom.data.stream.reader import is_local, resolve_source

    paths = [d for d in (data.split(",") if isinstance(data, str) else data) if d]
    if not paths:
        raise ValueError("--data is empty; pass a shard folder (with manifest.json), a brace pattern or a URL")
    for d in paths:
        if is_local(str(d)) and not any(c in str(d) for c in "{*?[") and not Path(d).exists():
            raise FileNotFoundError(f"--data {d}: no such folder or file; pass held-out shards made by `omniloom data build`")
    return [resolve_source(SourceConfig(path=str(d))) for d in paths]


def _iter_documents(sets, max_docs: int | None, skipped: Counter):
    """(doc_json, media) of every readable sample, in manifest order, up to max_docs."""
    from omniloom.data.stream.reader import SampleError, SampleReader

    seen = 0
    for shard_set in sets:
        reader = SampleReader(shard_set.shards)
        try:
            for si, shard in enumerate(shard_set.shards):
                for j in range(shard.num_samples):
                    if max_docs is not None and seen >= max_docs:
                        return
                    seen += 1
                    try:
                        yield reader.read_document(si, j)
                    except SampleError as err:
                        skipped[err.reason] += 1
                        log.warning("skipping %s sample %d: %s", shard.name, j, err)
        finally:
            reader.close()


def resample_patches(patches_ND: np.ndarray, grid: tuple[int, int, int], target: tuple[int, int, int], kind: int, settings) -> np.ndarray:
    """A visual block's patches re-tokenized to another grid: back to pixels, frames picked evenly
    and resized, then patchified again (the donor's content at the recipient's layout)."""
    from PIL import Image

    from omniloom.tokenizers.image import frames_to_patches, patches_to_frames

    tp = 1 if kind == IMAGE else settings.temporal_patch_size
    frames = patches_to_frames(patches_ND, grid, settings, tp)
    T, h, w = target
    p = settings.patch_size
    pick = np.linspace(0, frames.shape[0] - 1, T * tp).round().astype(int)
    resized = np.stack([np.asarray(Image.fromarray(frames[i]).resize((w * p, h * p), Image.BILINEAR)) for i in pick])
    out, got = frames_to_patches(resized, settings, tp)
    assert tuple(got) == tuple(target), (got, target)
    return out.astype(np.float32)


@torch.no_grad()
def _score_rows(model, pieces: list, patch_width: int, coverage: list | None = None):
    """Per-target CE, target modality and has-a-label mask, each [n, L], for n pieces of one
    length L scored in one forward, a piece a row (so nothing but the piece is in its context).
    `coverage`: gets (B-layer coverage [nB], L) when the model measures it."""
    from omniloom.data.batch import collate_rows
    from omniloom.tokenizers.layout import PAD_ID

    n, L = len(pieces), len(pieces[0])
    batch, _ = collate_rows([[piece] for piece in pieces], seq_len=L, pad_id=PAD_ID, patch_dim=patch_width,
                            patch_dtype="float32")
    make_layout = getattr(model, "batch_layout", None)  # read on the host copy: no device sync
    layout = make_layout(batch.doc_ids, batch.block_ids) if callable(make_layout) else None
    batch = batch.to(next(model.parameters()).device)
    with tuned(n * L):  # the first forwards choose the thread count when nobody did (threads.py)
        out = model(**batch.as_dict(), return_logits=True, **({"layout": layout} if layout is not None else {}))
    if coverage is not None and getattr(out, "block_coverage", None) is not None:
        coverage.append((out.block_coverage.double().cpu(), L))
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(n * L, -1), batch.labels.reshape(-1).clamp(min=0), reduction="none")
    return ce.reshape(n, L).cpu(), torch.roll(batch.modality, -1, dims=1).long().cpu(), (batch.labels != -100).cpu()


def _pieces_losses(model, pieces: list, patch_width: int, coverage: list | None = None):
    """One document's (CE, target modality, has-a-label) [L], its pieces scored one a forward."""
    scored = [_score_rows(model, [piece], patch_width, coverage) for piece in pieces]
    return tuple(torch.cat([s[j][0] for s in scored]) for j in range(3))


def _token_losses(model, doc, max_len: int, patch_width: int, coverage: list | None = None):
    """Per-target CE [L], target modality [L] and has-a-label mask [L] for one document, scored in
    pieces of at most `max_len` tokens cut as training cuts them (positions restart per piece).
    `coverage`: gets (B-layer coverage [nB], piece length) per piece when the model measures it."""
    from omniloom.data.packing import split_document

    return _pieces_losses(model, split_document(doc, max(max_len, 8)), patch_width, coverage)


def _token_losses_many(model, docs: list, max_len: int, patch_width: int, coverage: list | None = None) -> list:
    """`_token_losses` of each document, or the PackingError that refused it. Documents that fit
    in one piece share forwards with the others of their length, one row each (so a row still
    holds only its document): 300 held-out captions take a handful of forwards, not 300. With
    `coverage` (B layers measuring theirs per piece) each document runs alone."""
    from omniloom.data.packing import PackingError, split_document

    out: list = [None] * len(docs)
    groups: dict[int, list[tuple[int, object]]] = defaultdict(list)
    for i, doc in enumerate(docs):
        try:
            pieces = split_document(doc, max(max_len, 8))
        except PackingError as err:
            out[i] = err
            continue
        if len(pieces) > 1 or coverage is not None:
            out[i] = _pieces_losses(model, pieces, patch_width, coverage)
        else:
            groups[len(pieces[0])].append((i, pieces[0]))
    for L, members in sorted(groups.items()):
        per = max(1, min(EVAL_BATCH_TOKENS, max_len) // L)
        for at in range(0, len(members), per):
            rows = members[at:at + per]
            ce, mods, valid = _score_rows(model, [piece for _, piece in rows], patch_width)
            for r, (i, _) in enumerate(rows):
                out[i] = (ce[r], mods[r], valid[r])
    return out


def _doc_kind(doc) -> str:
    kinds = {b.kind for b in doc.blocks}
    if not kinds:
        return "text"
    if kinds == {IMAGE}:
        return "image"
    if kinds == {VIDEO}:
        return "video"
    return "mixed"


def evaluate(model, tokenizer, data: str | list[str], *, max_docs: int | None = None, max_len: int | None = None,
             progress: bool = True) -> dict:
    """Loss and perplexity per modality, per document kind, and the cross-modal gap (module doc).
    Returns the JSON-able result dict (keys `loss`, `perplexity`, `cross_modal_gap`, `counts`, ...)."""
    from omniloom.data.packing import PackingError
    from omniloom.tokenizers.layout import VisualBlock
    from omniloom.tokenizers.settings import DocumentError
    from omniloom.tokenizers.unified import tokenize_document

    if max_docs is not None and max_docs < 1:
        raise ValueError("--max-docs must be >= 1")
    max_len = max_len or DEFAULT_CONTEXT
    sets = _resolve_sources(data)
    available = sum(s.num_samples for s in sets)
    total = min(available, max_docs) if max_docs else available
    patch_width = max(tokenizer.patch_dim, tokenizer.tubelet_dim)
    model.eval()
    b_layers = [i for i, k in enumerate(model.cfg.layer_kinds()) if k == "B"] if hasattr(getattr(model, "cfg", None), "layer_kinds") else []
    coverage: list = []
    if b_layers:
        model.measure_attention = True  # B layers report their coverage of the dense attention
    skipped: Counter = Counter()
    by_mod, by_kind, gap = _Sums(), _Sums(), {"own": _Sums(), "donor": _Sums()}
    counts: Counter = Counter()
    pool: dict[int, deque] = {IMAGE: deque(maxlen=DONOR_POOL), VIDEO: deque(maxlen=DONOR_POOL)}
    pending: list[tuple[int, object, tuple]] = []  # visual docs seen before any donor of their kind
    per_doc: dict[str, list[tuple[float, int]]] = defaultdict(list)  # kind -> (donor - own CE sum, targets) per document

    def swap_in_donors(index: int, doc):
        """The document with every visual block replaced by a donor's (module doc), or None
        while no other document of that kind has been seen."""
        donors = []
        for blk in doc.blocks:
            cands = [d for d in reversed(pool[blk.kind]) if d.doc_index != index]
            if not cands:
                return None
            same = [d for d in cands if tuple(d.grid) == tuple(blk.grid)]
            donor = same[0] if same else cands[0]
            if same:
                patches = donor.patches_ND
            else:
                patches = resample_patches(donor.patches_ND, donor.grid, blk.grid, blk.kind, tokenizer.settings)
                counts["gap_donors_resampled"] += 1
            donors.append(VisualBlock(start=blk.start, length=blk.length, kind=blk.kind, patches_ND=patches, grid=blk.grid))
        return type(doc)(ids_L=doc.ids_L, modality_L=doc.modality_L, positions_3L=doc.positions_3L, blocks=donors, key=doc.key)

    def score_gaps(swaps: list) -> None:
        """Score the swapped documents together, then add each gap in document order.
        `swaps`: (doc, own (ce, modality, valid) from the main pass, swapped doc)."""
        donor_scores = _token_losses_many(model, [sw for _, _, sw in swaps], max_len, patch_width)
        for (doc, own, _), donor in zip(swaps, donor_scores):
            first_end = min(b.start + b.length for b in doc.blocks)
            kind = _doc_kind(doc)
            sums = {}
            for name, (ce, tmod, valid) in (("own", own), ("donor", donor)):
                sel = valid & ((tmod == TEXT) | (tmod == CODE))
                sel[:first_end] = False
                sums[name] = (float(ce[sel].sum()), int(sel.sum()))
                gap[name].add(kind, *sums[name])
            per_doc[kind].append((sums["donor"][0] - sums["own"][0], sums["own"][1]))
            counts[f"gap_docs_{kind}"] += 1

    def score_chunk(chunk: list) -> None:
        """Score read-ahead documents (index, doc) together, then account for them in order."""
        owns = _token_losses_many(model, [doc for _, doc in chunk], max_len, patch_width, coverage if b_layers else None)
        swaps = []
        for (index, doc), own in zip(chunk, owns):
            if isinstance(own, PackingError):
                skipped[own.reason] += 1
                continue
            ce, tmod, valid = own
            kind = _doc_kind(doc)
            counts["docs"] += 1
            counts[f"docs_{kind}"] += 1
            for m, name in enumerate(MODALITY_NAMES):
                sel = valid & (tmod == m)
                if bool(sel.any()):
                    by_mod.add(name, float(ce[sel].sum()), int(sel.sum()))
            by_mod.add("all", float(ce[valid].sum()), int(valid.sum()))
            by_kind.add(kind, float(ce[valid].sum()), int(valid.sum()))
            if doc.blocks and len(doc) > max_len:
                counts["gap_docs_too_long"] += 1  # a swap must keep the whole document in one context
            elif doc.blocks:
                swapped = swap_in_donors(index, doc)
                if swapped is None:
                    pending.append((index, doc, own))
                else:
                    swaps.append((doc, own, swapped))
                for blk in doc.blocks:
                    pool[blk.kind].append(_Donor(index, blk.kind, tuple(blk.grid), np.asarray(blk.patches_ND, dtype=np.float32)))
        if swaps:
            score_gaps(swaps)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="eval", unit="doc", leave=False)
    chunk: list = []
    chunk_tokens = 0
    for index, (doc_json, media) in enumerate(_iter_documents(sets, max_docs, skipped)):
        if bar is not None:
            bar.update()
        try:
            doc = tokenize_document(doc_json, media, tokenizer, key=str(index))
        except DocumentError as err:  # MediaError included
            skipped[getattr(err, "reason", "bad_document")] += 1
            log.warning("skipping document %d: %s", index, err)
            continue
        chunk.append((index, doc))
        chunk_tokens += len(doc)
        if len(chunk) >= EVAL_CHUNK_DOCS or chunk_tokens >= EVAL_CHUNK_TOKENS:
            score_chunk(chunk)
            chunk, chunk_tokens = [], 0
    if chunk:
        score_chunk(chunk)
    late = []  # donors from later documents
    for index, doc, own in pending:
        swapped = swap_in_donors(index, doc)
        if swapped is None:
            counts["gap_docs_without_donor"] += 1
        else:
            late.append((doc, own, swapped))
    if late:
        score_gaps(late)
    if bar is not None:
        bar.close()
    if counts["docs"] == 0:
        raise ValueError(f"no document of {data} could be evaluated (skipped: {dict(skipped)})")

    loss = {k: by_mod.mean(k) for k in ("all", *MODALITY_NAMES) if by_mod.mean(k) is not None}
    result = {
        "loss": loss,
        "perplexity": {k: _ppl(v) for k, v in loss.items()},
        "loss_by_doc_kind": {k: by_kind.mean(k) for k in sorted(by_kind.n)},
        "cross_modal_gap": {},
        "cross_modal_gap_detail": {},
        # docs: scored; docs_read: taken from the shards (max_docs of them at most); docs_available: in the shards
        "counts": {"docs": counts["docs"], "docs_read": total, "docs_available": available,
                   **{k: v for k, v in sorted(counts.items()) if k != "docs"},
                   "tokens": dict(by_mod.n), "skipped": dict(skipped)},
    }
    if b_layers:
        model.measure_attention = False
    if coverage:
        # the share of the dense attention mass the B layers' selected blocks hold (sampled query
        # blocks, mean over tokens and heads), per B layer, weighted by piece length
        w = sum(n for _, n in coverage)
        cov = sum(c * n for c, n in coverage) / w
        result["block_coverage"] = {**{f"layer{i}": float(c) for i, c in zip(b_layers, cov)}, "mean": float(cov.mean())}
    for kind in ("image", "video", "mixed"):
        own, donor = gap["own"].mean(kind), gap["donor"].mean(kind)
        value = None if own is None or donor is None else donor - own
        if kind != "mixed":
            result["cross_modal_gap"][kind] = value
        if value is not None:
            result["cross_modal_gap_detail"][kind] = {"own_visual_loss": own, "donor_visual_loss": donor, "gap": value,
                                                      "text_tokens": gap["own"].n[kind], "docs": counts[f"gap_docs_{kind}"],
                                                      **gap_interval(per_doc[kind])}
    return result


def _t975(df: int) -> float:
    """Student's t 97.5% quantile: exact for 1 and 2 degrees of freedom, else the Cornish-Fisher
    expansion around the normal quantile (within 1% from 3 on)."""
    if df <= 2:
        return (12.7062, 4.3027)[max(df, 1) - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def gap_interval(per_doc: list[tuple[float, int]]) -> dict:
    """Standard error and 95% interval of the gap sum(d) / sum(n) over documents (d: a document's
    donor-minus-own CE summed over its text targets, n: its targets); `distinguishable_from_zero`
    when the interval excludes 0. Fewer than 2 documents (or no targets): no interval."""
    docs = [(d, n) for d, n in per_doc if n > 0]
    total = sum(n for _, n in docs)
    if len(docs) < 2 or total <= 0:
        return {"stderr": None, "ci95": None, "distinguishable_from_zero": False}
    ratio = sum(d for d, _ in docs) / total
    m = len(docs)
    var = m / (m - 1) * sum((d - ratio * n) ** 2 for d, n in docs) / total ** 2
    se = math.sqrt(var)
    half = _t975(m - 1) * se
    lo, hi = ratio - half, ratio + half
    return {"stderr": se, "ci95": [lo, hi], "distinguishable_from_zero": bool(lo > 0 or hi < 0)}


def describe_gap(value: float | None, detail: dict | None) -> str:
    """'+0.1655 (95% CI -0.28 to +0.6117, 12 documents: not distinguishable from 0)' for the CLI,
    the demo's summary and the report (4 significant digits; the value alone for an eval.json
    written before intervals were)."""
    if value is None:
        return "n/a"
    detail = detail or {}
    if "ci95" not in detail:
        return f"{value:+.4g}"
    ci, docs = detail["ci95"], detail.get("docs")
    if not ci:
        return f"{value:+.4g} ({docs} document(s): too few for an interval; not distinguishable from 0)"
    verdict = "distinguishable from 0" if detail.get("distinguishable_from_zero") else "not distinguishable from 0"
    return f"{value:+.4g} (95% CI {ci[0]:+.4g} to {ci[1]:+.4g}, {docs} documents: {verdict})"


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


def json_safe(value, path: str = "") -> tuple[object, list[str]]:
    """(a copy of `value` with every NaN or infinity replaced by None, the dotted keys of those
    values). JSON has no NaN: json.dumps would write `NaN`, which no strict reader accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, [path]
    if isinstance(value, dict):
        items = [(k, json_safe(v, f"{path}.{k}" if path else str(k))) for k, v in value.items()]
        return {k: v for k, (v, _) in items}, [p for _, (_, bad) in items for p in bad]
    if isinstance(value, (list, tuple)):
        items = [json_safe(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]
        return [v for v, _ in items], [p for _, bad in items for p in bad]
    return value, []
