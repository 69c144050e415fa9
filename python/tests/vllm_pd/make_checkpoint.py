"""A tiny random Llama checkpoint for the P/D proof (no hub): 2 layers, hidden 256, 4 heads,
2 KV heads, vocab 1024, weights N(0, 1/fan_in), ``torch.manual_seed(0)``.

``python make_checkpoint.py DIR`` writes it to DIR (if DIR has none yet) and prints DIR.
"""

from __future__ import annotations

import json
import os
import sys


def make_checkpoint(path: str) -> str:
    if os.path.exists(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path)
    ):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    tmp = path + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "kvhandoff-checkpoint.json"), "w") as f:
        json.dump({"seed": 0, "std": "1/sqrt(fan_in)"}, f)
    os.replace(tmp, path) if not os.path.exists(path) else _move_into(tmp, path)
    return path


def _move_into(src: str, dst: str) -> None:
    for f in os.listdir(src):
        os.replace(os.path.join(src, f), os.path.join(dst, f))
    os.rmdir(src)


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "kvhandoff-tiny-llama"
    )
    print(make_checkpoint(target))
