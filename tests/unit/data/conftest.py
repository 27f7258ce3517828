"""Fixtures shared by the data tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def hf_tokenizer_dir(tmp_path: Path) -> Path:
    """A tiny word-level Hugging Face tokenizer trained locally and saved with save_pretrained (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    backend.train_from_iterator(["the cat sat on the mat", "a dog ran to the cat"], trainer)
    directory = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(directory)
    return directory
