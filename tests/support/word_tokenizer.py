"""A tiny word-level Hugging Face tokenizer, trained here with `tokenizers` and saved with
save_pretrained (nothing is downloaded), and the edits a hostile user makes to one."""
from __future__ import annotations

import json
from pathlib import Path

TEXTS = ["the cat sat on the mat", "a dog ran to the cat"]


def save_word_tokenizer(directory: Path, eos: str = "</s>") -> Path:
    """Save the tokenizer to `directory`: [UNK]=0, </s>=1, then the words of TEXTS (11 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token=eos).save_pretrained(directory)
    return Path(directory)


def swap_words(directory: Path, first: str = "cat", second: str = "dog") -> None:
    """Edit the tokenizer in place: two words trade ids. Same vocabulary size, same special ids,
    other text for the same ids: what a resume must refuse."""
    path = Path(directory) / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(data))


def give_own_code(directory: Path) -> Path:
    """Edit the tokenizer in place to need its own Python: tokenizer_config.json names a class in a
    file beside it (an `auto_map`, what trust_remote_code would run). The file, if it ever ran, writes
    the returned marker path."""
    directory = Path(directory)
    marker = directory / "code-ran"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)  # no class of transformers' own: only the directory's code would do
    config["auto_map"] = {"AutoTokenizer": [None, "own_tokenizer.OwnTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "own_tokenizer.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('yes')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass OwnTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    return marker


def corpus(documents: int = 64, words: int = 40) -> list[str]:
    """Documents of the tokenizer's words (a fixed pseudo-random order)."""
    vocabulary = sorted({w for text in TEXTS for w in text.split()})
    return [" ".join(vocabulary[(d * 7 + i * i + i) % len(vocabulary)] for i in range(words))
            for d in range(documents)]
