"""Build a tiny random-weight Llama model plus a locally trained tokenizer.

Everything happens offline and is seeded, so two builds produce the same weights and the
same tokenizer.  The shapes are chosen to satisfy the vLLM CPU attention backend
(head_dim 32 is supported; block_size must be a multiple of 32 at engine level).

Usage as a script::

    python -m testkit.tiny_model OUTDIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITION = 4096
SEED = 0

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _training_corpus() -> list[str]:
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "vLLM is a fast and easy-to-use library for LLM inference and serving.",
        "LMCache offloads KV cache blocks to CPU memory, local disk and remote storage.",
        "A lazy offload policy stores KV blocks only when they are about to be evicted.",
        "Hello world! This is a tiny random model used for testing KV connectors.",
        "Once upon a time there was a prefix cache that never forgot a token.",
    ]
    numbered = [" ".join(f"w{i}" for i in range(j, j + 40)) for j in range(0, 2000, 40)]
    return sentences * 50 + numbered


def build_tiny_llama(path: str | os.PathLike[str]) -> Path:
    """Write the tiny model and tokenizer into ``path`` and return it as a ``Path``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.model_max_length = MAX_POSITION
    fast.chat_template = CHAT_TEMPLATE

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION,
        rms_norm_eps=1e-5,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m testkit.tiny_model OUTDIR", file=sys.stderr)
        return 2
    out = build_tiny_llama(args[0])
    print(f"tiny llama written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
