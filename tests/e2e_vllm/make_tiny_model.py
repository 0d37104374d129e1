"""Build a tiny random-weight model vLLM can serve on CPU; run by the vLLM venv's Python.

    python make_tiny_model.py text   OUT_DIR    # LlamaForCausalLM (text only)
    python make_tiny_model.py vision OUT_DIR    # Qwen2VLForConditionalGeneration (images)

Nothing is downloaded (the machines reach no model hub): the tokenizer is a byte-level BPE with
1024 tokens trained on this Python's standard library sources, and the weights are random
(seed 0), so the text is gibberish, but greedy decoding is deterministic, which is all the
real-vLLM tests compare. A few seconds, about 1.5 MB.

Sizes are the smallest vLLM's CPU backend accepts: hidden 128, 2 layers, 4 attention heads and 2
KV heads (head dim 32; the CPU attention backend needs at least 32), bf16. The chat template is
ChatML and accepts OpenAI content-part lists (an image part becomes the vision placeholder).
Vision: Qwen2-VL with a 2-layer, 64-wide vision tower, images resized into 56^2..112^2 pixels
(16 to 64 patches). OUT_DIR is written next to itself and renamed into place when complete, so
an interrupted build never leaves a half model behind.
"""

import glob
import os
import shutil
import sys
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def chat_template(image_placeholder):
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['image', 'image_url'] %}{{ '" + image_placeholder + "' }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def stdlib_texts(limit=150):
    """Training text that every Python installation has, offline."""
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:limit]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            yield f.read()


def build_tokenizer(out_dir, extra_specials=(), image_placeholder=""):
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[*SPECIALS, *extra_specials], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(stdlib_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=list(extra_specials),
        chat_template=chat_template(image_placeholder), model_max_length=4096,
    )
    fast.save_pretrained(out_dir)
    return fast


def text_config(tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": ids("<s>"), "eos_token_id": ids("<|im_end|>"), "pad_token_id": ids("<pad>"),
    }


def save(model, out_dir, eos_token_id):
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_token_id, do_sample=False).save_pretrained(out_dir)


def build_text(out_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(out_dir)
    config = LlamaConfig(**text_config(tokenizer), torch_dtype="bfloat16")
    torch.manual_seed(0)
    save(LlamaForCausalLM(config), out_dir, config.eos_token_id)


def build_vision(out_dir):
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = build_tokenizer(out_dir, VISION_SPECIALS, IMAGE_PLACEHOLDER)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_SPECIALS}
    text = text_config(tokenizer)
    config = Qwen2VLConfig(
        text_config={**text, "model_type": "qwen2_vl_text", "rope_theta": 10000.0,
                     # M-RoPE sections sum to head_dim / 2 = 16.
                     "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
        vision_config={"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 2,
                       "mlp_ratio": 2, "in_channels": 3, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        torch_dtype="bfloat16",
        **{key: text[key] for key in ("vocab_size", "hidden_size", "bos_token_id", "eos_token_id")},
    )
    torch.manual_seed(0)
    save(Qwen2VLForConditionalGeneration(config), out_dir, text["eos_token_id"])
    sizes = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2}
    Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes), video_processor=Qwen2VLVideoProcessor(**sizes),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    ).save_pretrained(out_dir)


BUILDERS = {"text": build_text, "vision": build_vision}


def main(argv):
    if len(argv) != 3 or argv[1] not in BUILDERS:
        sys.exit(__doc__)
    kind, out_dir = argv[1], os.path.abspath(argv[2])
    partial = f"{out_dir}.partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        BUILDERS[kind](partial)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(partial, out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print("built", out_dir)


if __name__ == "__main__":
    main(sys.argv)
