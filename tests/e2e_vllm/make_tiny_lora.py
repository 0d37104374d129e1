"""Write a tiny random LoRA adapter for a tiny model, in PEFT's format; run by the vLLM venv's Python.

    python make_tiny_lora.py MODEL_DIR OUT_DIR SEED

Nothing is downloaded and no ``peft`` package is needed: an adapter on disk is
``adapter_config.json`` (``peft_type`` LORA, its rank, alpha and target modules) and
``adapter_model.safetensors`` holding ``base_model.model.model.layers.{i}.self_attn.{q,v}_proj``
``.lora_A.weight`` (``[r, hidden]``) and ``.lora_B.weight`` (``[out, r]``), random bf16 by
``SEED`` (two seeds: two adapters whose greedy answers differ from the base's and each other's).
The sizes come from the model's own ``config.json``. OUT_DIR is written next to itself and
renamed into place, so an interrupted run never leaves half an adapter.
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

RANK = 8


def main(model_dir: str, out: str, seed: int) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim,
               "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, size in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # Large enough to move a random model's greedy choices.
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(RANK, hidden, generator=generator) * 0.5).to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(size, RANK, generator=generator) * 0.5).to(torch.bfloat16)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(tensors, os.path.join(partial, "adapter_model.safetensors"))
    with open(os.path.join(partial, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": list(outputs),
                   "base_model_name_or_path": model_dir, "inference_mode": True}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(partial, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
