"""Whether a run learned, in figures a reader can judge without knowing the model: the eval loss
next to the loss of a model that guesses uniformly over the vocabulary (ln V nats), and the loss in
bits per byte for a byte-level tokenizer (bits per token otherwise)."""
from __future__ import annotations

import math


def uniform_loss(vocab_size: int) -> float:
    """The cross-entropy of a uniform guess over `vocab_size` tokens, ln V: a model that learned
    nothing starts near it (an initialised GPT's logits are close to equal)."""
    return math.log(vocab_size)


def bits(loss: float, tokenizer: str) -> tuple[str, float]:
    """(name, value): the loss in bits per byte for data.tokenizer=byte, where a token is one byte
    (end-of-document tokens count as bytes too), else in bits per token."""
    name = "bits_per_byte" if str(tokenizer) == "byte" else "bits_per_token"
    return name, loss / math.log(2)


def eval_summary(eval_loss: float, vocab_size: int, tokenizer: str) -> str:
    """`eval_loss 2.4351 (uniform 5.5491, 3.513 bits/byte)`, for the closing line."""
    name, value = bits(eval_loss, tokenizer)
    unit = "bits/byte" if name == "bits_per_byte" else "bits/token"
    loss = f"{eval_loss:.4f}" if abs(eval_loss) < 1e4 else f"{eval_loss:.4g}"
    return f"eval_loss {loss} (uniform {uniform_loss(vocab_size):.4f}, {value:.3f} {unit})"
