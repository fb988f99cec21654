"""Writes an offline Hugging Face cache holding facebook/opt-125m's config, for vLLM's tests.

vLLM's scheduler and connector tests build a ModelConfig for facebook/opt-125m; that reads the
model's config.json (and generation_config.json) through the hub cache. With the hub offline
and no cache, every such test fails (after about 100 s of retries). The files written here are
the model's public architecture description, written by hand: no weights and no tokenizer.

Usage: python write-hf-cache.py HF_HOME
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = "facebook/opt-125m"
SNAPSHOT = "0" * 40

CONFIG = {
    "_name_or_path": REPO,
    "_remove_final_layer_norm": False,
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "enable_bias": True,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layer_norm_elementwise_affine": True,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}

GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


def write(hf_home: Path) -> Path:
    repo_dir = hf_home / "hub" / ("models--" + REPO.replace("/", "--"))
    snap = repo_dir / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (snap / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(SNAPSHOT)
    return snap


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(f"wrote {write(Path(sys.argv[1]))}")
