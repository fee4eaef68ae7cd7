"""Tiny models built in-process for the example DAGs and CI: nothing is downloaded from a hub.

``build_tiny_chat_model`` writes a ~100 k-parameter Llama with a word-level tokenizer and a chat
template: its text is gibberish, but every part of a real chat model is there (chat template,
tokenizer, EOS, generation config), so the text-generation path runs end to end on a laptop, in
CI and on vLLM. ``build_tiny_image_classifier`` writes a tiny ViT trained for a few seconds to tell
red, green and blue images apart, so labels can be checked against the images a test writes.
Swap either for a real model (e.g. Qwen3-4B-Instruct) by logging its directory instead.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
CORPUS = [
    "summarize the support ticket in one short sentence",
    "the billing page fails with a timeout and shows the wrong total",
    "login keeps logging me out since the update of the mobile app",
    "export returns error 500 and invoices do not load at all",
    "notifications send duplicate emails to the whole team",
    "customer is blocked urgent please help the dashboard is very slow",
    "system user assistant ticket",
]
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


def build_tiny_chat_model(path: str | Path, seed: int = 0, hidden_size: int = 32, num_heads: int = 4) -> Path:
    """Save a tiny Llama causal LM and its tokenizer (with a chat template) to ``path``.

    GPU attention kernels want a head size of 64 or more: for vLLM use ``hidden_size=128, num_heads=2``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces: decode/encode round-trips
    core.train_from_iterator(
        [*CORPUS, ":"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"])
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # never emit <unk>, <pad> or <s>: generated text then re-tokenizes to exactly the generated tokens
    model.generation_config.suppress_tokens = [tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def color_image(color: str, size: tuple[int, int] = (48, 40), seed: int = 0):
    """A noisy image dominated by one of ``COLORS`` (PIL Image)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.array(COLORS[color], dtype=np.int16)
    pixels = base + rng.integers(-25, 26, size=(size[1], size[0], 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGB")


def build_tiny_image_classifier(path: str | Path, seed: int = 0, steps: int = 40) -> Path:
    """Save a tiny ViT (32x32, one layer) trained on synthetic red/green/blue images, and its processor."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification
    from transformers import ViTImageProcessorPil as Processor  # needs no torchvision

    path = Path(path)
    labels = list(COLORS)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
    )
    processor = Processor(size={"height": 32, "width": 32})
    torch.manual_seed(seed)
    model = ViTForImageClassification(config)
    images = [color_image(c, seed=seed * 1000 + i) for i in range(8) for c in labels]
    target = torch.tensor([labels.index(c) for _ in range(8) for c in labels])
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return path
