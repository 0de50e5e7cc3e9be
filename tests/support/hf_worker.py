"""Runs an export through Hugging Face in a process where omniloom cannot be imported (the tests in
test_hf_export.py start it with `python -I` outside the checkout). Usage:

    python -I hf_worker.py REQUEST.json OUT.pt

REQUEST: {"inputs": FILE.pt (tensors, read weights-only), "runs": {NAME: {"export": DIR, "tasks":
[...]}}}; each task writes its results under the run's and its own name into OUT.pt. Nothing here knows omniloom's internals: it sees
only what a Hugging Face user sees.
"""

from __future__ import annotations

import json
import sys
import time

T0 = time.perf_counter()


class _NoOmniloom:
    """Makes `import omniloom` fail, as on a machine without it (the editable install's finder
    would find it otherwise)."""

    def find_spec(self, name, path=None, target=None):
        if name == "omniloom" or name.startswith("omniloom."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, _NoOmniloom())

import torch  # noqa: E402
import transformers  # noqa: E402

LAYOUT = ("attention_mask", "positions", "doc_ids", "block_ids", "modality", "patches", "patch_kind")


def _batch(inputs, key):
    return {k[len(key) + 1:]: v for k, v in inputs.items() if k.startswith(key + ".")}


def task_omniloom_absent(ctx, arg):
    try:
        import omniloom  # noqa: F401
    except ModuleNotFoundError as err:
        return {"error": str(err)}
    return {"error": None}


def task_load(ctx, arg):
    exp = ctx["export"]
    cfg = transformers.AutoConfig.from_pretrained(exp, trust_remote_code=True)
    tok = transformers.AutoTokenizer.from_pretrained(exp, trust_remote_code=True)
    proc = transformers.AutoProcessor.from_pretrained(exp, trust_remote_code=True)
    model = ctx["model"]
    return {"config": type(cfg).__name__, "model_type": cfg.model_type, "model": type(model).__name__,
            "tokenizer_vocab": len(tok), "processor": type(proc).__name__, "dtype": str(model.dtype)}


def task_logits(ctx, arg):
    batch = _batch(ctx["inputs"], arg)
    with torch.no_grad():
        out = ctx["model"](input_ids=batch["input_ids"], **{k: batch[k] for k in LAYOUT if k in batch})
    return {"logits": out.logits}


def task_loss_grads(ctx, arg):
    model = ctx["model"]
    batch = _batch(ctx["inputs"], arg)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], labels=batch["input_ids"], **{k: batch[k] for k in LAYOUT if k in batch})
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"loss": out.loss.detach(), "grads": grads}


def task_processor(ctx, arg):
    """Processor output; an argument "@NAME" is the uint8 tensor NAME of the inputs file (frames)."""
    proc = transformers.AutoProcessor.from_pretrained(ctx["export"], trust_remote_code=True)
    arg = {k: ctx["inputs"][v[1:]].numpy() if isinstance(v, str) and v.startswith("@") else v for k, v in arg.items()}
    return {k: v for k, v in proc(**arg).items()}


def task_generate(ctx, arg):
    """arg: {"processor": processor kwargs, "generate": generate kwargs, "seed": int or None}."""
    proc = transformers.AutoProcessor.from_pretrained(ctx["export"], trust_remote_code=True)
    inputs = proc(**arg["processor"])
    if arg.get("seed") is not None:
        torch.manual_seed(arg["seed"])
    with torch.no_grad():
        seq = ctx["model"].generate(**inputs, **arg["generate"])
    return {"sequences": seq, "prompt_width": inputs["input_ids"].shape[1]}


def task_pipeline(ctx, arg):
    pipe = transformers.pipeline("text-generation", model=ctx["export"], trust_remote_code=True, device="cpu")
    return {"text": pipe(arg["prompt"], max_new_tokens=arg["max_new_tokens"], do_sample=False)[0]["generated_text"]}


def task_bf16(ctx, arg):
    model = transformers.AutoModelForCausalLM.from_pretrained(ctx["export"], trust_remote_code=True, dtype=torch.bfloat16)
    batch = _batch(ctx["inputs"], arg)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], **{k: batch[k] for k in LAYOUT if k in batch})
    return {"dtype": str(model.dtype), "logits": out.logits.float()}


def task_lora(ctx, arg):
    try:
        import peft
    except ImportError as err:
        return {"skipped": f"peft is not installed ({err})"}
    model = transformers.AutoModelForCausalLM.from_pretrained(ctx["export"], trust_remote_code=True)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=arg["targets"]))
    if arg.get("refused"):  # an adapter the model would skip: forward says so
        batch = _batch(ctx["inputs"], arg["batch"])
        try:
            lora(input_ids=batch["input_ids"], **{k: batch[k] for k in LAYOUT if k in batch})
        except ValueError as err:
            return {"error": str(err)}
        return {"error": None}
    params = [p for p in lora.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = _batch(ctx["inputs"], arg["batch"])
    losses = []
    for _ in range(3):
        out = lora(input_ids=batch["input_ids"], labels=batch["input_ids"], **{k: batch[k] for k in LAYOUT if k in batch})
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss))
    changed = sum(not torch.equal(a, b.detach()) for a, b in zip(before, params))
    frozen = sum(p.numel() for p in lora.parameters() if not p.requires_grad)
    out = {"losses": losses, "trainable": len(params), "changed": changed, "frozen": frozen}
    if arg.get("save"):  # the adapter as PEFT saves it, and PEFT's own merge of it, for train.init_from
        lora.save_pretrained(f"{arg['save']}/adapter")
        lora.merge_and_unload().save_pretrained(f"{arg['save']}/merged")
        out["saved"] = arg["save"]
    return out


def task_lm_eval(ctx, arg):
    """lm-evaluation-harness's `hf` model type on the export, over a task of local JSONL;
    the log-likelihood of each document's continuation, in document order."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        return {"skipped": f"lm-eval is not installed ({err})"}
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={ctx['export']},trust_remote_code=True,dtype=float32",
                                  tasks=[arg["task"]], task_manager=TaskManager(include_path=arg["tasks_dir"]),
                                  log_samples=True, batch_size=arg.get("batch_size", 2), device="cpu")
    samples = sorted(out["samples"][arg["task"]], key=lambda s: s["doc_id"])
    return {"loglikelihood": [float(s["resps"][0][0][0]) for s in samples], "version": lm_eval.__version__,
            "arguments": [s["arguments"] for s in samples]}


def task_save(ctx, arg):
    ctx["model"].save_pretrained(arg)
    return {"saved": arg}


def task_save_processor(ctx, arg):
    transformers.AutoProcessor.from_pretrained(ctx["export"], trust_remote_code=True).save_pretrained(arg)
    return {"saved": arg}


TASKS = {name[5:]: fn for name, fn in globals().items() if name.startswith("task_")}


def main() -> None:
    """REQUEST: {"inputs": FILE.pt or null, "runs": {NAME: {"export": DIR, "tasks": [[TASK, ARG], ...]}}}."""
    request = json.loads(open(sys.argv[1]).read())
    inputs = torch.load(request["inputs"], weights_only=True) if request.get("inputs") else {}
    results = {"seconds": {"start": time.perf_counter() - T0}}
    for run, spec in request["runs"].items():
        ctx = {"export": spec["export"], "inputs": inputs}
        ctx["model"] = transformers.AutoModelForCausalLM.from_pretrained(spec["export"], trust_remote_code=True)
        results[run] = {}
        for name, arg in spec["tasks"]:
            t0 = time.perf_counter()
            results[run][name] = TASKS[name.split(":")[0]](ctx, arg)
            results["seconds"][f"{run}/{name}"] = time.perf_counter() - t0
    torch.save(results, sys.argv[2])


if __name__ == "__main__":
    main()
