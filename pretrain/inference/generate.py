"""`omniloom generate`: sampling from an exported model, with a KV cache that keeps each layer
kind's attention rule (omniloom.model.kv_cache).

The prompt is one document in the unified layout: bos, then the visual block(s) (image first,
then video) tokenized by the export's own tokenizer, then the prompt text; no eos. Generated
tokens continue that document as text until eos or `max_new_tokens`.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then nucleus (top-p)
filtering, drawn with a seeded generator so a seed reproduces a sample.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch

from omniloom.pretrain.runtime.threads import tuned

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
    """One prompt document as model inputs (batch of one) plus its layout facts."""

    input_ids: torch.Tensor  # [1, S] int64
    positions: torch.Tensor  # [1, 3, S] int32
    modality: torch.Tensor  # [1, S] uint8
    block_ids: torch.Tensor  # [1, S] int32
    patches: torch.Tensor  # [P, Dp] float32
    patch_kind: torch.Tensor  # [P] uint8
    grids: list[tuple[int, int, int]]

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def random_text_prompt(vocab_size: int, length: int, patch_width: int) -> Prompt:
    """`length` random text ids (past the special and byte ids) as a Prompt, for benchmarks."""
    S = length
    return Prompt(input_ids=torch.randint(300, vocab_size, (1, S)),
                  positions=torch.arange(S, dtype=torch.int32).view(1, 1, S).expand(1, 3, S).contiguous(),
                  modality=torch.zeros(1, S, dtype=torch.uint8), block_ids=torch.full((1, S), -1, dtype=torch.int32),
                  patches=torch.zeros(0, patch_width), patch_kind=torch.zeros(0, dtype=torch.uint8), grids=[])


def build_prompt(tokenizer, text: str = "", *, image: bytes | None = None, video: bytes | None = None) -> Prompt:
    """Tokenize `[image] [video] text` as one document with the exported tokenizer and drop its eos.
    Media that cannot be decoded raise a ValueError naming the reason."""
    from omniloom.tokenizers.layout import EOS_ID
    from omniloom.tokenizers.unified import tokenize_document

    segments, media = [], {}
    if image is not None:
        segments.append({"type": "image", "ref": "prompt.img"})
        media["prompt.img"] = image
    if video is not None:
        segments.append({"type": "video", "ref": "prompt.vid"})
        media["prompt.vid"] = video
    if text:
        segments.append({"type": "text", "text": text})
    doc = tokenize_document({"segments": segments}, media, tokenizer, key="prompt")
    assert doc.ids_L[-1] == EOS_ID
    return prompt_from_doc(doc, drop_eos=True, patch_width=max(tokenizer.patch_dim, tokenizer.tubelet_dim))


def prompt_from_doc(doc, *, drop_eos: bool, patch_width: int) -> Prompt:
    """A TokenizedDoc as a batch of one (optionally without its final eos)."""
    L = len(doc) - (1 if drop_eos else 0)
    block_ids = np.full(L, -1, dtype=np.int32)
    rows, kinds = [], []
    for n, blk in enumerate(sorted(doc.blocks, key=lambda b: b.start)):
        block_ids[blk.start:blk.start + blk.length] = n
        pad = np.zeros((blk.length, patch_width), dtype=np.float32)
        pad[:, :blk.patches_ND.shape[1]] = blk.patches_ND
        rows.append(pad)
        kinds.append(np.full(blk.length, blk.kind, dtype=np.uint8))
    patches = torch.from_numpy(np.concatenate(rows)) if rows else torch.zeros(0, patch_width)
    kind = torch.from_numpy(np.concatenate(kinds)) if kinds else torch.zeros(0, dtype=torch.uint8)
    return Prompt(
        input_ids=torch.from_numpy(doc.ids_L[:L].astype(np.int64)).unsqueeze(0),
        positions=torch.from_numpy(doc.positions_3L[:, :L].astype(np.int32)).unsqueeze(0),
        modality=torch.from_numpy(doc.modality_L[:L].astype(np.uint8)).unsqueeze(0),
        block_ids=torch.from_numpy(block_ids).unsqueeze(0),
        patches=patches, patch_kind=kind, grids=[b.grid for b in doc.blocks],
    )


def sample_next(logits_BV: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from fp32 logits: greedy at temperature 0, else temperature + top-p."""
    if temperature <= 0:
        return logits_BV.argmax(-1)
    probs = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def forbid_patch_token(logits_BV: torch.Tensor, model) -> torch.Tensor:
    """The logits with `<|patch|>` made impossible: a generated patch token would have no pixel
    vector to embed (the model's embedding refuses it), so it can never be the next token."""
    patch_id = getattr(getattr(model, "cfg", None), "patch_token_id", -1)
    if 0 <= patch_id < logits_BV.shape[-1]:
        logits_BV = logits_BV.clone()
        logits_BV[..., patch_id] = float("-inf")
    return logits_BV


def _modality_of(token_id: int) -> int:
    from omniloom.tokenizers.layout import token_modality

    return token_modality(token_id)


def _full_logits(model, prompt: Prompt, new_ids: list[int]) -> torch.Tensor:
    """Logits of the last position by a full forward over prompt + new tokens (no cache)."""
    dev = next(model.parameters()).device
    n = len(new_ids)
    last = int(prompt.positions[0, 0, -1])
    ids = torch.cat([prompt.input_ids, torch.tensor([new_ids], dtype=torch.int64).view(1, n)], dim=1)
    pos_new = torch.arange(last + 1, last + 1 + n, dtype=torch.int32).view(1, 1, n).expand(1, 3, n)
    positions = torch.cat([prompt.positions, pos_new], dim=2)
    mod_new = torch.tensor([[_modality_of(t) for t in new_ids]], dtype=torch.uint8).view(1, n)
    modality = torch.cat([prompt.modality, mod_new], dim=1)
    block_ids = torch.cat([prompt.block_ids, torch.full((1, n), -1, dtype=torch.int32)], dim=1)
    S = ids.shape[1]
    out = model(
        input_ids=ids.to(dev), labels=torch.full((1, S), -100, dtype=torch.int64, device=dev),
        positions=positions.to(dev), doc_ids=torch.zeros(1, S, dtype=torch.int32, device=dev),
        block_ids=block_ids.to(dev), modality=modality.to(dev), patches=prompt.patches.to(dev),
        patch_kind=prompt.patch_kind.to(dev), return_logits=True,
    )
    return out.logits[:, -1]


@dataclasses.dataclass
class Generation:
    ids: list[int]  # generated token ids (eos included when it ended the generation)
    prompt_tokens: int
    stopped_by: str  # "eos" or "max_new_tokens"
    seconds: float
    cache_bytes: int = 0


@torch.no_grad()
def generate(model, prompt: Prompt, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, use_cache: bool = True, eos_id: int | None = None, progress: bool = False,
             offload_b: bool = False) -> Generation:
    """Continue `prompt` by up to `max_new_tokens` tokens. use_cache=False recomputes the whole
    sequence every step with the model's own forward (the reference the cache is tested against).
    offload_b: B layers' cached keys and values in host memory (CachedDecoder(offload_b=True)).
    The model runs in eval mode and is put back in its previous mode afterwards."""
    from omniloom.tokenizers.layout import EOS_ID

    if max_new_tokens < 0:
        raise ValueError("--max-new-tokens must be >= 0")
    if temperature < 0:
        raise ValueError("--temperature must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError("--top-p must be in (0, 1]")
    eos_id = EOS_ID if eos_id is None else eos_id
    dev = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        return _generate(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         gen=gen, use_cache=use_cache, eos_id=eos_id, progress=progress, dev=dev, offload_b=offload_b)
    finally:
        model.train(was_training)


def _generate(model, prompt: Prompt, *, max_new_tokens, temperature, top_p, gen, use_cache, eos_id, progress, dev,
              offload_b=False) -> Generation:
    from omniloom.model.kv_cache import CachedDecoder

    t0 = time.perf_counter()
    new: list[int] = []
    dec = None
    if use_cache:
        dec = CachedDecoder(model, offload_b=offload_b)
        logits = dec.prefill(prompt.input_ids.to(dev), prompt.positions.to(dev), prompt.modality.to(dev),
                             prompt.block_ids.to(dev), prompt.patches.to(dev), prompt.patch_kind.to(dev))
    else:
        logits = _full_logits(model, prompt, [])
    stopped = "max_new_tokens"
    bar = None
    if progress and max_new_tokens > 16:
        from tqdm import tqdm

        bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", leave=False)
    for _ in range(max_new_tokens):
        token = int(sample_next(forbid_patch_token(logits.float().cpu(), model), temperature=temperature, top_p=top_p,
                                generator=gen)[0])
        new.append(token)
        if bar is not None:
            bar.update()
        if token == eos_id:
            stopped = "eos"
            break
        if len(new) == max_new_tokens:
            break
        with tuned():  # the first decode steps choose the thread count when nobody did (threads.py)
            if dec is not None:
                logits = dec.step(torch.tensor([token], device=dev), _modality_of(token))
            else:
                logits = _full_logits(model, prompt, new)
    if bar is not None:
        bar.close()
    return Generation(ids=new, prompt_tokens=prompt.length, stopped_by=stopped, seconds=time.perf_counter() - t0,
                      cache_bytes=dec.cache_bytes() if dec is not None else 0)


def _build_prompt_naming_files(tok, prompt: str, media: dict, paths: dict):
    """build_prompt, with a media error naming the file it came from (--image or --video) in one
    plain line: PyAV's `[Errno N] ...: '<none>'` text becomes its message alone."""
    from omniloom.tokenizers.image import image_to_patches
    from omniloom.tokenizers.settings import MediaError

    try:
        return build_prompt(tok, prompt, image=media.get("image"), video=media.get("video"))
    except MediaError as err:
        culprit = "video"
        if "image" in media:
            try:
                image_to_patches(media["image"], tok.settings)
            except MediaError:
                culprit = "image"
        raise ValueError(f"--{culprit} {paths[culprit]}: {_plain_av_text(str(err), err.__cause__)}") from err
    except Exception as err:  # PyAV's own error, should one escape the video decoder unwrapped
        if "video" not in media or not _is_av_error(err):
            raise
        raise ValueError(f"--video {paths['video']}: undecodable: {_av_message(err)}") from err


def _is_av_error(err: BaseException | None) -> bool:
    try:
        import av
    except ImportError:
        return False
    return isinstance(err, av.FFmpegError)


def _plain_av_text(text: str, cause: BaseException | None) -> str:
    """`text` with the str() of a PyAV error in it (`[Errno 1094995529] Invalid data found when
    processing input: '<none>'`, maybe a log after it) replaced by the error's message alone, on
    one line."""
    if _is_av_error(cause):
        try:
            raw = str(cause)
        except Exception:  # a PyAV error built without its usual arguments
            raw = ""
        text = text.replace(raw, _av_message(cause)) if raw and raw in text else text
    return " ".join(text.split())


def _av_message(err: BaseException) -> str:
    """A PyAV error's message without its errno, file name ('<none>' for bytes) or FFmpeg log."""
    return " ".join(str(getattr(err, "strerror", None) or "").split()) or type(err).__name__


def generate_from_export(model_dir: str | Path, prompt: str = "", *, image: str | Path | None = None,
                         video: str | Path | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                         top_p: float = 1.0, seed: int = 0, device: str | None = None, use_cache: bool = True,
                         offload_b: bool = False, tokenizer: str | Path | None = None) -> tuple[str, Generation]:
    """Load an export folder and its tokenizer (or `tokenizer`, another folder holding the export's),
    build the prompt, generate; returns (text, Generation)."""
    from omniloom.model.pretrained import load_pretrained

    from .load import check_visual_blocks_fit, load_export_tokenizer

    tok = load_export_tokenizer(model_dir, tokenizer)  # reads config.json first: a folder that is no export says so
    check_visual_blocks_fit(tok, model_dir, image=image is not None, video=video is not None)  # before decoding
    media = {}
    for name, path in (("image", image), ("video", video)):
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"--{name} {p}: no such file")
            media[name] = p.read_bytes()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_pretrained(model_dir, device=device)
    if model.cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"{model_dir}: the model's vocabulary ({model.cfg.vocab_size}) differs from its tokenizer's "
                         f"({tok.vocab_size}); re-export the run")
    p = _build_prompt_naming_files(tok, prompt, media, {"image": image, "video": video})
    result = generate(model, p, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                      use_cache=use_cache, progress=True, offload_b=offload_b)
    ids = result.ids[:-1] if result.stopped_by == "eos" else result.ids
    return tok.decode(ids), result
