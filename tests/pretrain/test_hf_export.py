"""Issue 26: an export runs in Hugging Face transformers (AutoConfig, AutoModelForCausalLM,
AutoTokenizer, AutoProcessor, generate, pipeline, labels/backward, PEFT) in a process where
omniloom cannot be imported, and gives omniloom's numbers.

Every Hugging Face check runs in `hf_worker.py` (`python -I`, outside the checkout, `import
omniloom` blocked and proven blocked); one worker run per export answers all the tests of this
file, against references computed here with omniloom itself."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig, VisionEncoderConfig
from omniloom.tokenizers.testing import make_image_bytes, make_tiny_tokenizer, make_video_bytes
from omniloom.tokenizers.text import Tokenizer

_spec = importlib.util.spec_from_file_location("hf_check", (Path(__file__).resolve().parents[1] / "support" / "hf_check.py"))
hf_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_check)
run_worker = hf_check.run_worker
NEW_TOKENS = 32
# one export per B-layer selector; together they hold L, G, B-pooled and B-indexer layers, MoE
# with a shared expert and modality groups (the allowed-expert table a meta-device load must refill)
EXPORTS = {
    "pooled": dict(pattern="LGB", selector="pooled", modality_groups=True),
    # ... and the settings of issue 29 (interleaved M-RoPE, learned visual positions, the conv
    # patch stem with clips' frames through the image stem, as the demo ships it): config fields
    # the Hugging Face side knows nothing about, carried by omniloom's own code
    "indexer": dict(pattern="GBL", selector="indexer", modality_groups=False,
                    extra=dict(rope_layout="interleaved", visual_pos_max=16, patch_stem="conv", conv_stem_width=8,
                               conv_stem_video="frames")),
    # issue 42's late fusion: a vision encoder over each visual block, carried in the remote code
    "encoder": dict(pattern="LGB", selector="pooled", modality_groups=False,
                    extra=dict(vision_encoder=VisionEncoderConfig(enabled=True, dim=16, num_heads=2, num_layers=2))),
}
LAYER_TASKS = ("omniloom_absent", "load", "logits", "loss_grads", "generate")
TEXT_PROMPT = "The river bends twice"
IMAGE_PROMPT = "A picture of"


def make_export(tok_dir: Path, out: Path, *, pattern: str, selector: str, modality_groups: bool, extra: dict | None = None,
                seed: int = 0) -> Path:
    from omniloom.model import OmniModel
    from omniloom.pretrain.export.write import save_export

    tok = Tokenizer.load(tok_dir)
    cfg = ModelConfig(dim=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size,
                      patch_token_id=tok.patch_id, pad_token_id=3, rope_sections=(2, 2, 4), patch_dim=tok.patch_dim,
                      tubelet_dim=tok.tubelet_dim,
                      attention=AttentionConfig(backend="sdpa", pattern=pattern, window=12, block_size=8,
                                                num_selected_blocks=3, selector=selector, indexer_dim=8,
                                                indexer_heads=2, indexer_rope_dim=4),
                      moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_shared_experts=1,
                                    num_dense_layers=1, dense_dim=32, modality_groups=modality_groups),
                      **(extra or {}))
    torch.manual_seed(seed)
    model = OmniModel(cfg)
    with torch.no_grad():  # non-zero balancing biases: they must load too
        for layer in model.layers:
            if layer.is_moe:
                layer.ffn.router_bias.normal_(0, 0.05)
    save_export(model, tok_dir, out)
    return out


def documents(media: Path) -> list[dict]:
    """A text, a code, an image and a video document, their media saved under `media`."""
    media.mkdir(parents=True, exist_ok=True)
    (media / "img.png").write_bytes(make_image_bytes(40, 24, seed=1))
    (media / "vid.mp4").write_bytes(make_video_bytes(seconds=1.0, fps=4, width=32, height=24))
    return [
        [{"type": "text", "text": "The river bends twice before it reaches the old mill."}],
        [{"type": "text", "text": "Code:\n"}, {"type": "code", "lang": "python", "text": "def f(x):\n    return x * 2\n"}],
        [{"type": "image", "image": str(media / "img.png")}, {"type": "text", "text": "A photograph of a gradient."}],
        [{"type": "video", "video": str(media / "vid.mp4")}, {"type": "text", "text": "A short clip."}],
    ]


def omniloom_doc(segments: list[dict]):
    """The same document as omniloom's doc.json + media bytes."""
    segs, media = [], {}
    for i, seg in enumerate(segments):
        kind = seg["type"]
        if kind in ("image", "video"):
            media[f"m{i}"] = Path(seg[kind]).read_bytes()
            seg = {"type": kind, "ref": f"m{i}"}
        segs.append(seg)
    return {"segments": segs}, media


def packed_batch(tok: Tokenizer, docs: list[list[dict]], seq_len: int = 96):
    """omniloom's PackedBatch of the documents: two per row, the rest padding."""
    from omniloom.data.batch import collate_rows
    from omniloom.data.packing import split_document
    from omniloom.tokenizers.unified import tokenize_document

    pieces = [p for segs in docs for p in split_document(tokenize_document(*omniloom_doc(segs), tok), seq_len)]
    rows = [pieces[i:i + 2] for i in range(0, len(pieces), 2)]
    assert all(sum(len(p) for p in row) <= seq_len for row in rows)
    batch, _ = collate_rows(rows, seq_len=seq_len, pad_id=3, patch_dim=max(tok.patch_dim, tok.tubelet_dim),
                            patch_dtype="float32")
    return batch


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Exports, inputs and one worker run per export (shared by the tests below)."""
    root = tmp_path_factory.mktemp("hf")
    tok_dir = root / "tok"
    make_tiny_tokenizer(tok_dir)
    tok = Tokenizer.load(tok_dir)
    docs = documents(root / "media")
    batch = packed_batch(tok, docs)
    assert {2, 3} <= set(batch.modality.unique().tolist()) and 1 in batch.modality.tolist()[0] + batch.modality.tolist()[1]
    fields = ("input_ids", "positions", "doc_ids", "block_ids", "modality", "patches", "patch_kind")
    inputs = {f"packed.{k}": getattr(batch, k) for k in fields}
    frames = np.stack([np.full((20, 28, 3), 40 * i, np.uint8) for i in range(5)])
    inputs["frames"] = torch.from_numpy(frames)
    pixels = np.random.default_rng(0).integers(0, 256, (30, 44, 3), dtype=np.uint8)
    inputs["pixels"] = torch.from_numpy(pixels)
    image = str(root / "media" / "img.png")
    gen = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    tasks = [
        ("omniloom_absent", None), ("load", None), ("logits", "packed"), ("loss_grads", "packed"),
        ("generate:text", {"processor": {"text": TEXT_PROMPT}, "generate": gen}),
        ("generate:image", {"processor": {"text": IMAGE_PROMPT, "images": image}, "generate": gen}),
        ("generate:video", {"processor": {"text": IMAGE_PROMPT, "videos": str(root / "media" / "vid.mp4")}, "generate": gen}),
        ("generate:batch", {"processor": {"text": [IMAGE_PROMPT, TEXT_PROMPT + " and on"], "images": [[image], []]},
                            "generate": gen}),
        ("generate:nocache", {"processor": {"text": TEXT_PROMPT}, "generate": {**gen, "max_new_tokens": 6, "use_cache": False}}),
        ("generate:sample1", {"processor": {"text": TEXT_PROMPT}, "seed": 7,
                              "generate": {"max_new_tokens": 10, "do_sample": True, "temperature": 0.8, "top_p": 0.9}}),
        ("generate:sample2", {"processor": {"text": TEXT_PROMPT}, "seed": 7,
                              "generate": {"max_new_tokens": 10, "do_sample": True, "temperature": 0.8, "top_p": 0.9}}),
        ("generate:returns", {"processor": {"text": IMAGE_PROMPT, "images": image}, "seed": 3,
                              "generate": {"max_new_tokens": 4, "do_sample": True, "num_return_sequences": 2}}),
        ("processor:docs", {"documents": docs, "eos": True}),
        ("processor:frames", {"text": "Frames", "videos": "@frames"}),
        ("processor:pixels", {"text": "Pixels", "images": "@pixels"}),
        ("pipeline", {"prompt": TEXT_PROMPT, "max_new_tokens": 8}),
        ("bf16", "packed"), ("lora", {"targets": ["wo", "w_down"], "batch": "packed", "save": str(root / "lora")}),
        ("lora:fused", {"targets": ["wq", "wv"], "batch": "packed", "refused": True}),
        ("save", str(root / "saved_by_hf")), ("save_processor", str(root / "saved_by_hf")),
    ]
    runs = {}
    for name, spec in EXPORTS.items():
        export = make_export(tok_dir, root / f"export_{name}", **spec)
        # every check on the first export; the second (the other B-layer selector) goes through
        # the checks that depend on the layers: logits, loss, gradients and generation
        mine = tasks if name == "pooled" else [t for t in tasks if t[0].split(":")[0] in LAYER_TASKS]
        runs[name] = {"export": export, "tasks": mine}
    results = run_worker(runs, root / "work", inputs)
    out = {name: (run["export"], results[name]) for name, run in runs.items()}
    return {"root": root, "tok_dir": tok_dir, "tok": tok, "docs": docs, "batch": batch, "frames": frames, "pixels": pixels,
            "image": image, "results": out}


@pytest.fixture(scope="module", params=sorted(EXPORTS))
def case(request, setup):
    export, results = setup["results"][request.param]
    return export, results


@pytest.fixture(scope="module")
def pooled(setup):
    """The export every check runs on (the ones below do not depend on the layer kinds)."""
    return setup["results"]["pooled"]


def omniloom_model(export):
    """A fresh load_pretrained model of the export (tests backpropagate through it)."""
    from omniloom.model.pretrained import load_pretrained

    return load_pretrained(export)


def test_omniloom_is_not_importable_and_every_auto_class_loads(case):
    export, res = case
    assert "No module named 'omniloom'" in res["omniloom_absent"]["error"]
    assert res["load"] == {"config": "OmniloomConfig", "model_type": "omniloom", "model": "OmniloomForCausalLM",
                           "tokenizer_vocab": 512, "processor": "OmniloomProcessor", "dtype": "torch.float32"}


def test_logits_equal_load_pretrained_on_a_packed_batch_with_text_code_image_and_video(case, setup):
    export, res = case
    batch = setup["batch"]
    with torch.no_grad():
        want = omniloom_model(export)(**batch.as_dict(), return_logits=True).logits
    torch.testing.assert_close(res["logits"]["logits"], want, rtol=0, atol=1e-5)


def test_labels_give_omniloom_loss_and_gradients(case, setup):
    """labels=input_ids (Hugging Face's convention) gives the loss of omniloom's packed batch, whose
    labels data/batch.py builds (no target across documents, at padding or at patches)."""
    export, res = case
    model = omniloom_model(export)
    out = model(**setup["batch"].as_dict())
    out.loss.backward()
    got = res["loss_grads"]
    torch.testing.assert_close(got["loss"], out.loss.detach(), rtol=1e-6, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def _omniloom_generate(export, tok, text, image=None, video=None, max_new_tokens=NEW_TOKENS):
    from omniloom.pretrain.inference.generate import build_prompt, generate

    prompt = build_prompt(tok, text, image=Path(image).read_bytes() if image else None,
                          video=Path(video).read_bytes() if video else None)
    return generate(omniloom_model(export), prompt, max_new_tokens=max_new_tokens).ids


def _new_tokens(res, row=0):
    seq = res["sequences"][row, res["prompt_width"]:].tolist()
    return seq


@pytest.mark.parametrize("which", ["text", "image", "video"])
def test_greedy_generate_equals_omniloom_generate(case, setup, which):
    export, res = case
    want = _omniloom_generate(export, setup["tok"], TEXT_PROMPT if which == "text" else IMAGE_PROMPT,
                              image=setup["image"] if which == "image" else None,
                              video=setup["root"] / "media" / "vid.mp4" if which == "video" else None)
    got = _new_tokens(res[f"generate:{which}"])
    assert got[:len(want)] == want
    assert len(want) == NEW_TOKENS or want[-1] == 2  # 32 tokens, unless eos came first


def test_batched_left_padded_generation_equals_one_by_one(case, setup):
    export, res = case
    got = res["generate:batch"]
    assert got["sequences"].shape[0] == 2
    for row, (text, image) in enumerate([(IMAGE_PROMPT, setup["image"]), (TEXT_PROMPT + " and on", None)]):
        want = _omniloom_generate(export, setup["tok"], text, image=image)
        assert _new_tokens(got, row)[:len(want)] == want, row


def test_generate_without_cache_sampling_and_several_returns(pooled, setup):
    export, res = pooled
    want = _omniloom_generate(export, setup["tok"], TEXT_PROMPT, max_new_tokens=6)
    assert _new_tokens(res["generate:nocache"])[:len(want)] == want
    a, b = _new_tokens(res["generate:sample1"]), _new_tokens(res["generate:sample2"])
    assert a == b and 1 <= len(a) <= 10 and all(0 <= t < 512 for t in a)
    assert res["generate:returns"]["sequences"].shape[0] == 2


def test_processor_builds_omniloom_documents_and_prompts(pooled, setup):
    """documents= gives tokenize_document's ids, positions, modality, blocks and patches exactly; a
    prompt (text + image) gives what `omniloom generate` builds; frames tokenize as omniloom's
    tokenize_document tokenizes them."""
    from omniloom.pretrain.inference.generate import build_prompt
    from omniloom.tokenizers.unified import tokenize_document

    _, res = pooled
    tok = setup["tok"]
    got = res["processor:docs"]
    S = got["input_ids"].shape[1]
    patches = []
    for row, segs in enumerate(setup["docs"]):
        doc = tokenize_document(*omniloom_doc(segs), tok)
        L = len(doc)
        assert got["attention_mask"][row].tolist() == [0] * (S - L) + [1] * L
        assert got["input_ids"][row, S - L:].tolist() == doc.ids_L.tolist()
        assert np.array_equal(got["positions"][row, :, S - L:].numpy(), doc.positions_3L)
        assert np.array_equal(got["modality"][row, S - L:].numpy(), doc.modality_L)
        blocks = np.full(L, -1)
        for n, blk in enumerate(doc.blocks):
            blocks[blk.start:blk.start + blk.length] = n
            patches.append(blk.patches_ND)
        assert got["block_ids"][row, S - L:].tolist() == blocks.tolist()
    for want, have in zip(patches, np.split(got["patches"].numpy(), np.cumsum([p.shape[0] for p in patches])[:-1])):
        assert np.array_equal(have[:, :want.shape[1]], want) and not have[:, want.shape[1]:].any()
    prompt = build_prompt(tok, IMAGE_PROMPT, image=Path(setup["image"]).read_bytes())
    frames = tokenize_document({"segments": [{"type": "video", "ref": "v"}, {"type": "text", "text": "Frames"}]},
                               {"v": setup["frames"]}, tok)
    assert res["processor:frames"]["input_ids"][0].tolist() == frames.ids_L[:-1].tolist()
    assert np.array_equal(res["processor:frames"]["patches"].numpy(), frames.blocks[0].patches_ND)
    pixels = tokenize_document({"segments": [{"type": "image", "ref": "i"}, {"type": "text", "text": "Pixels"}]},
                               {"i": setup["pixels"]}, tok)
    got = res["processor:pixels"]
    assert got["input_ids"][0].tolist() == pixels.ids_L[:-1].tolist()
    assert np.array_equal(got["patches"].numpy()[:, :tok.patch_dim], pixels.blocks[0].patches_ND)
    assert prompt.length > 0  # the image prompt's own check is the generation test above


def test_pipeline_text_generation(pooled, setup):
    export, res = pooled
    from transformers import PreTrainedTokenizerFast

    ids = _omniloom_generate(export, setup["tok"], TEXT_PROMPT, max_new_tokens=8)
    # decoded as Hugging Face decodes (a stray UTF-8 byte piece of a random model's output is
    # spelled differently by SentencePiece)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(export / "tokenizer.json"))
    assert res["pipeline"]["text"] == TEXT_PROMPT + hf_tok.decode(ids, skip_special_tokens=True)


def test_bf16_loads_and_stays_close(pooled):
    _, res = pooled
    assert res["bf16"]["dtype"] == "torch.bfloat16"
    torch.testing.assert_close(res["bf16"]["logits"], res["logits"]["logits"], rtol=0, atol=0.15)


def test_lora_adapter_trains_three_steps(pooled):
    _, res = pooled
    lora = res["lora"]
    if "skipped" in lora:
        pytest.skip(lora["skipped"])
    assert lora["trainable"] > 0 and lora["changed"] == lora["trainable"] and lora["frozen"] > 0
    assert all(np.isfinite(lora["losses"])) and lora["losses"][-1] < lora["losses"][0]
    # LoRA on a projection the model reads as a fused weight would change nothing: refused by name
    assert "layers.0.attn.wq is wrapped" in res["lora:fused"]["error"] and "apply LoRA" in res["lora:fused"]["error"]



def test_a_folder_saved_by_hugging_face_loads_in_omniloom(pooled, setup):
    """save_pretrained keeps config.json's omniloom keys and omniloom's weight names: a model
    fine-tuned in Hugging Face comes back to load_pretrained (and to train.init_from)."""
    export, res = pooled
    saved = Path(res["save"]["saved"])
    info = json.loads((saved / "config.json").read_text())
    assert info["format"] == "omniloom-export" and info["model"] == json.loads((export / "config.json").read_text())["model"]
    batch = setup["batch"]
    with torch.no_grad():
        want = omniloom_model(export)(**batch.as_dict(), return_logits=True).logits
        got = omniloom_model(saved)(**batch.as_dict(), return_logits=True).logits
    assert torch.equal(got, want)


def test_generate_on_a_folder_saved_by_hugging_face(pooled, setup, tmp_path, capsys):
    """Issue 41 item 3: `generate` / `eval` (one tokenizer loader) on a save_pretrained folder advised `omniloom tokenizer
    train` (a new tokenizer has other ids). The processor's save_pretrained now carries omniloom's
    two tokenizer files, so the folder works as the export does; a folder without them says to copy
    them from the export (or to save the processor), and --tokenizer EXPORT works."""
    import shutil

    from omniloom.pretrain.cli import main

    export, res = pooled
    saved = Path(res["save"]["saved"])
    assert (saved / "tokenizer.model").read_bytes() == (export / "tokenizer.model").read_bytes()
    assert (saved / "omniloom_tokenizer.json").is_file()
    outs = []
    for folder in (export, saved):
        assert main(["-qq", "generate", str(folder), "--prompt", "The river", "--max-new-tokens", "6"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
    bare = tmp_path / "model_only"
    bare.mkdir()
    for p in saved.iterdir():
        if p.name in ("config.json", "model.safetensors") or p.suffix == ".py":
            shutil.copy(p, bare / p.name)
    assert main(["-qq", "generate", str(bare), "--prompt", "The river", "--max-new-tokens", "6"]) == 2
    err = capsys.readouterr().err
    assert "holds no omniloom tokenizer" in err and "copy those two files" in err and "omniloom tokenizer train" not in err
    assert err.count("\n") == 1
    assert main(["-qq", "generate", str(bare), "--tokenizer", str(export), "--prompt", "The river", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == outs[0]


def test_init_from_a_peft_lora_adapter_merges_it_onto_its_base_export(pooled, tmp_path):
    """Issue 41 item 3: `train.init_from=ADAPTER_DIR` said "has no config.json" without a word about
    merging. The adapter is merged onto the export its adapter_config.json names, giving the
    weights PEFT's own merge_and_unload gives."""
    import dataclasses
    import shutil

    from omniloom.model import OmniModel
    from omniloom.model.pretrained import model_config_from_dict, read_safetensors
    from omniloom.pretrain.config.run import RunConfig
    from omniloom.pretrain.train.init_from import check_init_from, load_init_weights

    export, res = pooled
    if "skipped" in res["lora"]:
        pytest.skip(res["lora"]["skipped"])
    adapter, merged = Path(res["lora"]["saved"]) / "adapter", Path(res["lora"]["saved"]) / "merged"
    assert check_init_from(str(adapter)) == adapter
    cfg = dataclasses.replace(RunConfig(), model=model_config_from_dict(json.loads((export / "config.json").read_text())["model"]))
    model = OmniModel(cfg.model)
    load_init_weights(model, adapter, cfg)
    want, got = read_safetensors(merged), model.state_dict()
    base = read_safetensors(export)
    changed = [n for n in want if not torch.equal(want[n], base[n])]
    assert changed and all(n.endswith((".wo.weight", ".w_down.weight")) for n in changed)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # an adapter whose base is not here says how to point it there, or to merge it with PEFT
    moved = tmp_path / "adapter"
    shutil.copytree(adapter, moved)
    conf = json.loads((moved / "adapter_config.json").read_text())
    conf["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"is a PEFT LoRA adapter of .*gone.*set base_model_name_or_path in .*merge_and_unload"):
        check_init_from(str(moved))
    conf.update(base_model_name_or_path=str(export), use_dora=True)
    (moved / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="use_dora is set; merge it with PEFT"):
        check_init_from(str(moved))


LM_EVAL_TASK = """task: omniloom_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow  # importing lm-eval alone takes most of a minute here
def test_lm_evaluation_harness_hf_model_type_gives_omniloom_loglikelihoods(pooled, setup):
    """`lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True` on a task over a
    local JSONL file (no network): its log-likelihoods are omniloom's for the same token ids.
    Batched by two, so rows of different lengths are padded."""
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (optional: pip install lm-eval)")
    export, _ = pooled
    tok = setup["tok"]
    docs = [{"context": "The river bends twice", "continuation": " before it reaches the old mill"},
            {"context": "def f(x):\n", "continuation": "    return x * 2"},
            {"context": "Trains leave the station every", "continuation": " 15 minutes"}]
    tasks_dir = setup["root"] / "lm_eval_tasks"
    tasks_dir.mkdir(exist_ok=True)
    (tasks_dir / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks_dir / "omniloom_local.yaml").write_text(LM_EVAL_TASK.format(data=tasks_dir / "data.jsonl"))
    res = run_worker({"lm": {"export": export, "tasks": [("lm_eval", {"task": "omniloom_local", "tasks_dir": str(tasks_dir)})]}},
                     setup["root"] / "work_lm_eval")["lm"]["lm_eval"]
    model = omniloom_model(export)
    want = []
    for d in docs:  # lm-eval's split: the context's trailing whitespace moves to the continuation; the
        # context's own ids, then the whole text's ids past as many (their seam may differ from the whole's)
        context = d["context"].rstrip()
        whole, ctx = tok.encode(d["context"] + d["continuation"]), tok.encode(context)
        whole = ctx + whole[len(ctx):]
        ids = torch.tensor([whole])
        S = ids.shape[1]
        with torch.no_grad():
            logits = model(input_ids=ids, labels=torch.full_like(ids, -100), positions=torch.arange(S).expand(1, 3, S),
                           doc_ids=torch.zeros_like(ids), block_ids=torch.full_like(ids, -1),
                           modality=torch.zeros_like(ids, dtype=torch.uint8), patches=torch.zeros(0, 384),
                           patch_kind=torch.zeros(0, dtype=torch.uint8), return_logits=True).logits
        logp = logits[0, :-1].log_softmax(-1)
        want.append(float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), S))))
    assert res["loglikelihood"] == pytest.approx(want, abs=1e-4)
