"""Make a large .txt input and a byte-level BPE tokenizer for timing megaframe-preprocess (BENCHMARKS.md,
"megaframe-preprocess of one 100 MB .txt"); nothing is downloaded.

    python tools/make_text_corpus.py OUT_DIR [--bytes N]

writes OUT_DIR/big.txt (pydoc's topics, repeated to at least N bytes, 100,000,000 by default) and
OUT_DIR/bpe/ (a byte-level BPE of 8,000 tokens trained on the topics, saved with save_pretrained).
"""
from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--bytes", type=int, default=100_000_000)
    args = parser.parse_args()
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(topics[key] for key in sorted(topics))
    big = args.out / "big.txt"
    with open(big, "w", encoding="utf-8") as file:
        while file.tell() < args.bytes:
            file.write(text)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>").save_pretrained(args.out / "bpe")
    print(f"{big} ({big.stat().st_size:,} bytes) and {args.out / 'bpe'}")


if __name__ == "__main__":
    main()
