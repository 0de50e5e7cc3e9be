"""The Hugging Face files of an export besides the remote code: the keys config.json gains, and
generation_config.json and processor_config.json (docs/huggingface.md lists them all)."""

from __future__ import annotations

import json
from pathlib import Path

from .remote_code import remote_code_files

MODEL_CLASS = "OmniloomForCausalLM"
AUTO_MAP = {
    "AutoConfig": "configuration_omniloom.OmniloomConfig",
    "AutoModel": f"modeling_omniloom.{MODEL_CLASS}",
    "AutoModelForCausalLM": f"modeling_omniloom.{MODEL_CLASS}",
    "AutoProcessor": "processing_omniloom.OmniloomProcessor",
}
GENERATION_CONFIG = "generation_config.json"
PROCESSOR_CONFIG = "processor_config.json"


def config_keys(tokenizer_info: dict) -> dict:
    """What config.json adds for Hugging Face. `prefix`: the text-generation pipeline puts it
    before every prompt, so a prompt starts with <s> as omniloom's documents do."""
    specials = tokenizer_info.get("special_ids") or {}
    return {"model_type": "omniloom", "architectures": [MODEL_CLASS], "auto_map": dict(AUTO_MAP),
            "bos_token_id": specials.get("bos"), "eos_token_id": specials.get("eos"),
            "pad_token_id": specials.get("pad"), "tie_word_embeddings": False, "use_cache": True, "prefix": "<s>"}


def hf_file_names() -> list[str]:
    """Every file write_hf_files writes (the export's own listing of its Hugging Face part)."""
    return sorted([*remote_code_files("0"), GENERATION_CONFIG, PROCESSOR_CONFIG])


def write_hf_files(out: Path, tokenizer_info: dict, version: str) -> list[Path]:
    """Write the remote code, generation_config.json and processor_config.json into `out`."""
    specials = tokenizer_info.get("special_ids") or {}
    written = []
    for name, text in remote_code_files(version).items():
        (out / name).write_text(text)
        written.append(out / name)
    # <|patch|> is never generated (it stands for pixels), as in `omniloom generate`
    generation = {"bos_token_id": specials.get("bos"), "eos_token_id": specials.get("eos"),
                  "pad_token_id": specials.get("pad"), "suppress_tokens": [specials["patch"]] if "patch" in specials else []}
    processor = {"processor_class": "OmniloomProcessor", "auto_map": {"AutoProcessor": AUTO_MAP["AutoProcessor"]},
                 "media": tokenizer_info.get("media") or {}}
    for name, obj in ((GENERATION_CONFIG, generation), (PROCESSOR_CONFIG, processor)):
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")
        written.append(out / name)
    return written
