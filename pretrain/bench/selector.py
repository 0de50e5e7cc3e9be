"""Train the same tiny model three ways on a long-range task and compare the B-layer
selectors: a dense reference (pattern `LG`), `B` layers with the pooled selector and `B` layers
with the learned indexer (pattern `LB`, same dense warm-up for both).

    python -m omniloom.pretrain.bench.selector [--steps 400] [--seq-len 1024] [--warmup 150]

Tasks (synthetic, so the run needs no data and the answer is known; one document per row):
- `copy` (default): random tokens, then the same tokens again. A token of the copy is predicted
  by attending to the key next to its earlier occurrence, half a row back: the selector must
  find that block among all earlier blocks.
- `code`: real text, the Python standard library's own source files read as bytes (one file
  window per row; files are split into training and held-out by a hash of their path, so the
  held-out rows come from files never trained on). The long-range tokens are those a copy from
  beyond the window predicts: the label continues an earlier occurrence of the last 8 bytes that
  lies further back than the L layers' window (identifiers, repeated calls, imports used later).
- `recall`: a memory of `payload marker` pairs with markers unique in the row, then queries
  `marker payload` asking for the payload stored with that marker (harder: a tiny model needs
  thousands of steps). Printed per variant: held-out loss (all tokens), held-out recall loss (the
tokens a long-range look-up predicts), and for B layers the coverage of the dense attention mass by the selected
blocks and the indexer's KL at the start and the end of training.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import time

import torch

VOCAB, N_PAYLOAD, MARKER0 = 1024, 256, 512  # payloads [0, 256), markers [512, 1024)


def copy_batch(batch_size: int, seq_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """PackedBatch fields of `batch_size` copy rows (random tokens, then the same again), plus
    `recall_mask` [B, S]: the label positions inside the copy (predictable from the first half)."""
    half = seq_len // 2
    first = torch.randint(0, N_PAYLOAD, (batch_size, half), generator=generator)
    ids = torch.cat([first, first, first[:, : seq_len - 2 * half]], dim=1)
    recall = torch.zeros_like(ids, dtype=torch.bool)
    recall[:, half - 1: 2 * half - 1] = True  # the label of position i is token i + 1
    return _fields(ids, recall)


CODE_MATCH = 8  # code task: an earlier 8-byte match beyond the window marks a long-range token


class CodeCorpus:
    """The standard library's .py files as bytes, split into train / held-out files by path hash."""

    def __init__(self, seq_len: int, held_out_share: float = 0.1):
        import hashlib
        import pathlib
        import sysconfig

        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        self.train, self.held_out = [], []
        for path in sorted(root.rglob("*.py")):
            if "site-packages" in path.parts:
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if len(data) <= seq_len:
                continue
            h = int(hashlib.sha1(str(path.relative_to(root)).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
            (self.held_out if h < held_out_share else self.train).append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if len(self.train) < 10 or len(self.held_out) < 2:
            raise SystemExit(f"the standard library at {root} has too few .py files longer than {seq_len} bytes for --task code")
        self.seq_len = seq_len

    def batch(self, batch_size: int, window: int, generator: torch.Generator, held_out: bool = False) -> dict[str, torch.Tensor]:
        files = self.held_out if held_out else self.train
        rows = []
        for _ in range(batch_size):
            f = files[int(torch.randint(len(files), (1,), generator=generator))]
            o = int(torch.randint(len(f) - self.seq_len + 1, (1,), generator=generator))
            rows.append(f[o: o + self.seq_len].long())
        ids = torch.stack(rows)
        return _fields(ids, long_range_tokens(ids, window))


def long_range_tokens(ids: torch.Tensor, window: int, match: int = CODE_MATCH) -> torch.Tensor:
    """[B, S] bool at position i when the label ids[i + 1] continues an earlier occurrence of
    ids[i - match + 1 : i + 1] that ends more than `window` tokens back (the latest such one)."""
    out = torch.zeros_like(ids, dtype=torch.bool)
    for b, row in enumerate(ids.tolist()):
        last: dict[tuple, int] = {}
        pending: collections.deque = collections.deque()  # n-grams count once they leave the window
        for i in range(match - 1, len(row) - 1):
            while pending and pending[0][1] < i - window:
                key, end = pending.popleft()
                last[key] = end
            key = tuple(row[i - match + 1: i + 1])
            j = last.get(key)
            if j is not None and row[j + 1] == row[i + 1]:
                out[b, i] = True
            pending.append((key, i))
    return out


def _fields(ids: torch.Tensor, recall: torch.Tensor) -> dict[str, torch.Tensor]:
    batch_size, seq_len = ids.shape
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    pos = torch.arange(seq_len).expand(batch_size, seq_len)
    return {
        "input_ids": ids, "labels": labels, "positions": pos.unsqueeze(1).expand(batch_size, 3, seq_len).to(torch.int32),
        "doc_ids": torch.zeros(batch_size, seq_len, dtype=torch.int32),
        "block_ids": torch.full((batch_size, seq_len), -1, dtype=torch.int32),
        "modality": torch.zeros(batch_size, seq_len, dtype=torch.uint8),
        "patches": torch.zeros(0, 8), "patch_kind": torch.zeros(0, dtype=torch.uint8), "recall_mask": recall,
    }


def recall_batch(batch_size: int, seq_len: int, n_query: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """PackedBatch fields of `batch_size` recall rows (text only, one document per row), plus
    `recall_mask` [B, S]: the label positions of the queried payloads."""
    n_mem = (seq_len - 2 * n_query) // 2
    if n_mem < n_query or n_mem > VOCAB - MARKER0:
        raise ValueError(f"seq_len {seq_len}: the memory holds {n_mem} pairs; need {n_query} to {VOCAB - MARKER0}")
    ids = torch.empty(batch_size, seq_len, dtype=torch.long)
    for b in range(batch_size):
        markers = MARKER0 + torch.randperm(VOCAB - MARKER0, generator=generator)[:n_mem]
        payload = torch.randint(0, N_PAYLOAD, (n_mem,), generator=generator)
        mem = torch.stack([payload, markers], dim=1).reshape(-1)  # p m p m ...
        ask = torch.randint(0, n_mem, (n_query,), generator=generator)
        qry = torch.stack([markers[ask], payload[ask]], dim=1).reshape(-1)  # m p m p ...
        row = torch.cat([mem, qry])
        ids[b, : row.numel()] = row
        ids[b, row.numel():] = payload[0]  # a short tail when seq_len is odd
    recall = torch.zeros_like(ids, dtype=torch.bool)
    start = 2 * n_mem
    recall[:, start: start + 2 * n_query: 2] = True  # a query marker: its label is the payload
    return _fields(ids, recall)


def make_model(pattern: str, selector: str, args):
    from omniloom.model import OmniModel
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig

    cfg = ModelConfig(
        dim=args.dim, num_layers=len(pattern), num_heads=4, num_kv_heads=2, vocab_size=VOCAB, patch_token_id=-1,
        rope_sections=(args.dim // 4 // 4 * 2, args.dim // 4 // 4 * 2, args.dim // 4 - 2 * (args.dim // 4 // 4 * 2)),
        patch_dim=8, tubelet_dim=8, z_loss_coef=0.0,
        attention=AttentionConfig(backend="blocksparse", pattern=pattern, window=args.window, block_size=args.block_size,
                                  num_selected_blocks=args.num_selected, selector=selector, indexer_dim=32, indexer_heads=2,
                                  indexer_rope_dim=args.indexer_rope_dim,
                                  dense_warmup_steps=args.warmup, indexer_loss_coef=1.0),
        moe=MoEConfig(num_experts=0, dense_dim=4 * args.dim, num_dense_layers=len(pattern)),
    )
    torch.manual_seed(args.seed)
    return OmniModel(cfg)


def _forward(model, batch, measure: bool = False):
    model.measure_attention = measure
    fields = {k: v for k, v in batch.items() if k != "recall_mask"}
    out = model(**fields, return_logits=measure)
    model.measure_attention = False
    return out


@torch.no_grad()
def held_out(model, batches) -> dict:
    model.eval()
    ce = rec = n = nr = 0.0
    cov = []
    for batch in batches:
        out = _forward(model, batch, measure=True)
        labels = batch["labels"]
        lp = torch.log_softmax(out.logits.float(), -1)
        tok = -lp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        valid = labels != -100
        ce += float(tok[valid].sum())
        n += float(valid.sum())
        rec += float(tok[batch["recall_mask"]].sum())
        nr += float(batch["recall_mask"].sum())
        if out.block_coverage is not None:
            cov.append(out.block_coverage)
    model.train()
    res = {"loss": ce / n, "recall_loss": rec / nr}
    if cov:
        res["coverage"] = [round(float(c), 4) for c in torch.stack(cov).mean(0)]
    return res


def make_batch(args, g: torch.Generator, held_out: bool = False) -> dict[str, torch.Tensor]:
    if args.task == "code":
        return args.corpus.batch(args.batch_size, args.window, g, held_out=held_out)
    if args.task == "copy":
        return copy_batch(args.batch_size, args.seq_len, g)
    return recall_batch(args.batch_size, args.seq_len, args.n_query, g)


def train_variant(name: str, pattern: str, selector: str, args, eval_batches) -> dict:
    from omniloom.model.decoder import is_indexer_param

    model = make_model(pattern, selector, args)
    lm_params = [p for n, p in model.named_parameters() if not is_indexer_param(n)]
    index_params = [p for n, p in model.named_parameters() if is_indexer_param(n)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    g = torch.Generator().manual_seed(args.seed + 1)
    kl_trace = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        model.set_step(step)
        batch = make_batch(args, g)
        out = _forward(model, batch)
        out.loss.backward()
        # as the trainer does: the index branches clipped by their own norm
        torch.nn.utils.clip_grad_norm_(lm_params, 1.0)
        if index_params:
            torch.nn.utils.clip_grad_norm_(index_params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if out.indexer_kl is not None:
            kl_trace.append(float(out.indexer_kl.mean()))
        if args.verbose and step % 50 == 0:
            print(f"  {name} step {step} loss {float(out.ce_loss.detach()):.4f}" + (f" kl {kl_trace[-1]:.4f}" if kl_trace else ""), flush=True)
    model.set_step(args.steps)
    res = {"variant": name, "pattern": pattern, "selector": selector if "B" in pattern else "-",
           "train_s": round(time.perf_counter() - t0, 1), **held_out(model, eval_batches)}
    if kl_trace:
        k = max(1, len(kl_trace) // 10)
        res["kl_first"] = round(sum(kl_trace[:k]) / k, 4)
        res["kl_last"] = round(sum(kl_trace[-k:]) / k, 4)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniloom.pretrain.bench.selector", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=150, help="dense warm-up steps of the B variants")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--task", choices=("copy", "recall", "code"), default="copy")
    p.add_argument("--n-query", type=int, default=64, help="recall task: queries per row")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-selected", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="dense,pooled,indexer")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--indexer-rope-dim", type=int, default=16, help="index dims (of 32) rotated by position; 0: no position")
    p.add_argument("--repeat", type=int, default=1, help="layers: the pattern LG (dense) / LB repeated this often")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    args.corpus = CodeCorpus(args.seq_len) if args.task == "code" else None
    g = torch.Generator().manual_seed(12345)
    eval_batches = [make_batch(args, g, held_out=True) for _ in range(args.eval_batches)]
    specs = {"dense": ("LG" * args.repeat, "pooled"), "pooled": ("LB" * args.repeat, "pooled"),
             "indexer": ("LB" * args.repeat, "indexer")}
    rows = []
    for name in args.variants.split(","):
        pattern, selector = specs[name]
        rows.append(train_variant(name, pattern, selector, args, eval_batches))
        print("BENCH_SELECTOR " + json.dumps(rows[-1]), flush=True)
    dense = next((r for r in rows if r["variant"] == "dense"), None)
    if dense is not None:
        for r in rows:
            if r is not dense:
                print(f"{r['variant']}: held-out loss {r['loss']:.4f} = {r['loss'] / dense['loss']:.3f}x dense; "
                      f"recall loss {r['recall_loss']:.4f} (dense {dense['recall_loss']:.4f}); coverage {r.get('coverage')}"
                      + (f"; KL {r['kl_first']} -> {r['kl_last']}" if "kl_first" in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
