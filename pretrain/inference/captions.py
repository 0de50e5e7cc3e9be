"""`omniloom eval --captions`: can the model say what it sees? Greedy captions from the visual block.

For every held-out *captioned visual document* (one image or video segment, then text and nothing
else, as the demo's synthetic shapes and motion clips are), the visual block alone is the prompt
(`<s> <|image|> <|patch|>... <|/image|>`), the model greedily continues it until eos, and the
continuation is compared with the document's text:

- **exact**: the share of documents whose generated caption equals the true one (whitespace at
  the ends ignored), per visual kind;
- **attributes**: where the captions follow a known grammar (the demo's: "a large red circle at
  the top left.", "a blue square moves up."; `omniloom.data.prep.demo_corpus.parse_caption`), the
  accuracy of every attribute (colour, size, shape, row, column, motion direction) against the
  majority baseline (always answering the most common true value);
- **probes**, the same greedy captions after transforming the pixels: `mirror` (left-right), `flip`
  (top-bottom), `shuffle` (the patches of the block permuted at random; a model that reads an
  image as a bag of patches does not notice), and for videos `reverse` (frames in reverse order).
  Each reports the share of captions that changed, and, for the demo grammar, the share whose
  position/direction word changed among the documents where it should (mirror: not in the centre
  column; flip: not in the middle row; reverse: every clip) and the share that changed to exactly
  the transformed truth (left <-> right, top <-> bottom, up <-> down).

Decoding is batched over documents with the same prompt layout (images of one grid), with the KV
cache of `omniloom generate`, so a few hundred documents take seconds on a CPU.

Legend: N documents in a decoding group, S sequence so far, V vocabulary.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

PROBES = ("mirror", "flip", "shuffle", "reverse")
# grammar attribute that a probe should change, and how the truth changes under it
PROBE_TARGETS = {
    "mirror": ("column", {"left": "right", "right": "left", "center": "center"}),
    "flip": ("row", {"top": "bottom", "bottom": "top", "middle": "middle"}),
    "reverse": ("direction", {"left": "right", "right": "left", "up": "down", "down": "up"}),
}
UNCHANGED_BY = {"mirror": "center", "flip": "middle"}  # the truth value a probe leaves as it is
MAX_BATCH_TOKENS = 16384  # rows x tokens per decoding forward
MAX_CAPTION_TOKENS = 64  # most tokens generated per document (a longer text cannot match exactly)


@dataclass
class CaptionDoc:
    kind: str  # "image" or "video"
    caption: str
    prompt: object  # TokenizedDoc of the visual block alone (eos included; dropped when decoding)


def captioned_visual(doc_json: dict) -> tuple[str, dict, str] | None:
    """(kind, visual segment, caption) when the document is one visual segment followed only by
    text (the caption), else None."""
    segs = doc_json.get("segments") if isinstance(doc_json, dict) else None
    if not isinstance(segs, list) or len(segs) < 2 or not isinstance(segs[0], dict):
        return None
    kind = segs[0].get("type")
    if kind not in ("image", "video") or not all(isinstance(s, dict) and s.get("type") == "text" for s in segs[1:]):
        return None
    caption = "".join(str(s.get("text", "")) for s in segs[1:]).strip()
    return (kind, segs[0], caption) if caption else None


def transform_block(patches_ND: np.ndarray, grid: tuple[int, int, int], kind: str, probe: str, settings,
                    rng: np.random.Generator) -> np.ndarray:
    """A visual block's patch vectors after a probe's pixel transform (same grid and layout). The
    normalized values are moved as they are (no round trip through uint8 pixels)."""
    if probe == "shuffle":
        return patches_ND[rng.permutation(patches_ND.shape[0])]
    tp = 1 if kind == "image" else settings.temporal_patch_size
    frames = _frames_float(patches_ND, grid, settings, tp)
    if probe == "mirror":
        frames = frames[:, :, ::-1]
    elif probe == "flip":
        frames = frames[:, ::-1]
    elif probe == "reverse":
        frames = frames[::-1]
    else:
        raise ValueError(f"unknown probe {probe!r}")
    return _patches_float(np.ascontiguousarray(frames), grid, settings, tp).astype(patches_ND.dtype, copy=False)


def _frames_float(patches_ND: np.ndarray, grid, settings, tp: int) -> np.ndarray:
    """Patch vectors [N, 3*tp*p*p] laid out (c, t, y, x) -> float frames [T*tp, H, W, 3]."""
    T, h, w = grid
    p = settings.patch_size
    x = patches_ND.reshape(T, h, w, 3, tp, p, p)
    return x.transpose(0, 4, 1, 5, 2, 6, 3).reshape(T * tp, h * p, w * p, 3)


def _patches_float(frames: np.ndarray, grid, settings, tp: int) -> np.ndarray:
    """Inverse of `_frames_float`."""
    T, h, w = grid
    p = settings.patch_size
    x = frames.reshape(T, tp, h, p, w, p, 3)
    return x.transpose(0, 2, 4, 6, 1, 3, 5).reshape(T * h * w, 3 * tp * p * p)


@torch.no_grad()
def greedy_captions(model, prompts: list, *, max_new_tokens: int, eos_id: int, patch_width: int) -> list[list[int]]:
    """Greedy continuations (eos excluded) of each prompt TokenizedDoc (its final eos dropped).
    Prompts with the same layout (length and last position: images of one grid) are decoded
    together, a batch row each, with the KV cache of `omniloom generate`."""
    from omniloom.model.kv_cache import CachedDecoder
    from omniloom.tokenizers.layout import FIRST_BYTE_ID, SPECIAL, TEXT

    from .generate import forbid_patch_token, prompt_from_doc

    dev = next(model.parameters()).device
    out: list[list[int] | None] = [None] * len(prompts)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, doc in enumerate(prompts):
        groups[(len(doc) - 1, int(doc.positions_3L[0, len(doc) - 2]))].append(i)
    for (L, _), members in sorted(groups.items()):
        per = max(1, MAX_BATCH_TOKENS // (L + max_new_tokens))
        for at in range(0, len(members), per):
            idx = members[at:at + per]
            ps = [prompt_from_doc(prompts[i], drop_eos=True, patch_width=patch_width) for i in idx]
            dec = CachedDecoder(model)
            logits = dec.prefill(*(torch.cat([getattr(p, f) for p in ps]).to(dev)
                                   for f in ("input_ids", "positions", "modality", "block_ids", "patches", "patch_kind")))
            N = len(idx)
            done = torch.zeros(N, dtype=torch.bool)
            new = []
            for k in range(max_new_tokens):
                nxt = forbid_patch_token(logits.float().cpu(), model).argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
                new.append(nxt)
                if bool(done.all()) or k + 1 == max_new_tokens:
                    break
                mod = torch.where(nxt < FIRST_BYTE_ID, SPECIAL, TEXT)
                logits = dec.step(nxt.to(dev), mod)
            ids = torch.stack(new, dim=1)
            for row, i in enumerate(idx):
                toks = ids[row].tolist()
                out[i] = toks[:toks.index(eos_id)] if eos_id in toks else toks
    return out  # type: ignore[return-value]


def _load_caption_docs(tokenizer, data, max_docs: int | None, skipped: Counter) -> list[CaptionDoc]:
    from omniloom.tokenizers.settings import DocumentError
    from omniloom.tokenizers.unified import tokenize_document

    from .evaluate import _iter_documents, _resolve_sources

    docs = []
    for index, (doc_json, media) in enumerate(_iter_documents(_resolve_sources(data), None, skipped)):
        found = captioned_visual(doc_json)
        if found is None:
            skipped["not_a_captioned_visual"] += 1
            continue
        kind, seg, caption = found
        try:
            prompt = tokenize_document({"segments": [seg]}, media, tokenizer, key=str(index))
        except DocumentError as err:  # MediaError included
            skipped[getattr(err, "reason", "bad_document")] += 1
            continue
        docs.append(CaptionDoc(kind=kind, caption=caption, prompt=prompt))
        if max_docs is not None and len(docs) >= max_docs:
            break
    return docs


def _with_patches(doc, patches_ND: np.ndarray):
    from omniloom.tokenizers.layout import VisualBlock

    (blk,) = doc.blocks
    return type(doc)(ids_L=doc.ids_L, modality_L=doc.modality_L, positions_3L=doc.positions_3L,
                     blocks=[VisualBlock(start=blk.start, length=blk.length, kind=blk.kind, patches_ND=patches_ND, grid=blk.grid)],
                     key=doc.key)


def caption_benchmark(model, tokenizer, data, *, max_docs: int | None = None, probes: bool = True,
                      max_new_tokens: int | None = None, seed: int = 0) -> dict:
    """The caption benchmark of the module doc, as a JSON-able dict (see `format_captions`)."""
    from omniloom.data.prep.demo_corpus import parse_caption
    from omniloom.tokenizers.layout import EOS_ID

    skipped: Counter = Counter()
    docs = _load_caption_docs(tokenizer, data, max_docs, skipped)
    result: dict = {"docs": {"image": 0, "video": 0}, "skipped": dict(skipped)}
    if not docs:
        log.warning("no captioned image or video documents (a visual segment followed only by text) in %s", data)
        return result
    model.eval()
    patch_width = max(tokenizer.patch_dim, tokenizer.tubelet_dim)
    if max_new_tokens is None:  # room for the longest true caption and a little more; long texts are no captions
        max_new_tokens = min(max(len(tokenizer.encode(d.caption)) for d in docs) + 4, MAX_CAPTION_TOKENS)

    def decode(prompts) -> list[str]:
        ids = greedy_captions(model, prompts, max_new_tokens=max_new_tokens, eos_id=EOS_ID, patch_width=patch_width)
        return [tokenizer.decode(t).strip() for t in ids]

    preds = decode([d.prompt for d in docs])
    rng = np.random.default_rng(seed)
    probe_preds: dict[str, list[tuple[int, str]]] = {}
    if probes:
        for probe in PROBES:
            members = [i for i, d in enumerate(docs) if probe != "reverse" or d.kind == "video"]
            members = [i for i in members if probe == "shuffle" or probe == "reverse" or docs[i].kind == "image"]
            if not members:
                continue
            changed_prompts = []
            for i in members:
                (blk,) = docs[i].prompt.blocks
                moved = transform_block(blk.patches_ND, blk.grid, docs[i].kind, probe, tokenizer.settings, rng)
                changed_prompts.append(_with_patches(docs[i].prompt, moved))
            probe_preds[probe] = list(zip(members, decode(changed_prompts)))

    for d in docs:
        result["docs"][d.kind] += 1
    result["exact"] = {}
    for kind in ("image", "video"):
        members = [i for i, d in enumerate(docs) if d.kind == kind]
        if members:
            result["exact"][kind] = sum(preds[i] == docs[i].caption for i in members) / len(members)
    truths = [parse_caption(d.caption) for d in docs]
    guesses = [parse_caption(p) for p in preds]
    grammar = all(t is not None for t in truths)
    result["grammar"] = "demo" if grammar else None
    if grammar:
        result["attributes"] = _attribute_table(docs, truths, guesses)
    if probe_preds:
        result["probes"] = {}
        for probe, pairs in probe_preds.items():
            entry = {"docs": len(pairs), "changed": sum(p != preds[i] for i, p in pairs) / len(pairs)}
            if grammar and probe in PROBE_TARGETS:
                entry.update(_probe_attribute(probe, pairs, truths, guesses))
            result["probes"][probe] = entry
    result["examples"] = [{"kind": docs[i].kind, "true": docs[i].caption, "generated": preds[i]}
                          for i in _spread(len(docs), 6)]
    return result


def _spread(n: int, k: int) -> list[int]:
    return sorted(set(np.linspace(0, n - 1, min(n, k)).round().astype(int).tolist()))


def _attribute_table(docs, truths, guesses) -> dict:
    """Per kind, per attribute: accuracy of the generated value, and the majority baseline."""
    table: dict = {}
    for kind in ("image", "video"):
        members = [i for i, d in enumerate(docs) if d.kind == kind]
        if not members:
            continue
        names = [a for a in truths[members[0]] if a != "kind"]
        rows = {}
        for a in names:
            values = Counter(truths[i][a] for i in members)
            top, top_n = values.most_common(1)[0]
            hits = sum(guesses[i] is not None and guesses[i].get(a) == truths[i][a] for i in members)
            rows[a] = {"accuracy": hits / len(members), "majority": top_n / len(members), "majority_value": top}
        table[kind] = rows
    return table


def _probe_attribute(probe: str, pairs, truths, guesses) -> dict:
    """For a probe that should move one attribute: among documents whose true value it moves, the
    share whose generated value changed, and the share equal to the transformed truth."""
    from omniloom.data.prep.demo_corpus import parse_caption

    attr, swap = PROBE_TARGETS[probe]
    keep = UNCHANGED_BY.get(probe)
    moved = [(i, p) for i, p in pairs if truths[i].get(attr) is not None and truths[i][attr] != keep]
    if not moved:
        return {}
    changed = correct = 0
    for i, p in moved:
        after = (parse_caption(p) or {}).get(attr)
        before = (guesses[i] or {}).get(attr)
        changed += after != before
        correct += after == swap[truths[i][attr]]
    return {f"{attr}_docs": len(moved), f"{attr}_changed": changed / len(moved), f"{attr}_transformed": correct / len(moved)}


def format_captions(res: dict) -> list[str]:
    """The benchmark as printable lines (tables in Markdown)."""
    lines = []
    docs = res.get("docs", {})
    if not res.get("exact"):
        return ["captions: no captioned image or video documents"]
    lines.append("exact captions: " + ", ".join(f"{k} {v:.1%} of {docs[k]}" for k, v in res["exact"].items()))
    for kind, rows in (res.get("attributes") or {}).items():
        lines.append(f"| {kind} attribute | accuracy | majority baseline |")
        lines.append("|---|---|---|")
        lines += [f"| {a} | {r['accuracy']:.1%} | {r['majority']:.1%} ({r['majority_value']}) |" for a, r in rows.items()]
    probes = res.get("probes") or {}
    if probes:
        lines.append("| probe | docs | captions changed | position/direction word changed | ... to the transformed truth |")
        lines.append("|---|---|---|---|---|")
        for name, p in probes.items():
            attr = PROBE_TARGETS.get(name, (None,))[0]
            moved = f"{p[attr + '_changed']:.1%} of {p[attr + '_docs']} ({attr})" if attr and attr + "_changed" in p else "-"
            right = f"{p[attr + '_transformed']:.1%}" if attr and attr + "_transformed" in p else "-"
            lines.append(f"| {name} | {p['docs']} | {p['changed']:.1%} | {moved} | {right} |")
    examples = res.get("examples") or []
    if examples:
        lines.append(f"examples ({len(examples)}, spread over the documents; = exact, x not):")
        for ex in examples:
            mark = "=" if ex["generated"] == ex["true"] else "x"
            lines.append(f"  {mark} {ex['kind']:<5}  true: {ex['true']!r}")
            lines.append(f"           generated: {ex['generated']!r}")
    return lines
