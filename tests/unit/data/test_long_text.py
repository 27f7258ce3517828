""".txt inputs are read and tokenized in pieces (megaframe/data/long_text.py): the tokens are those of
the whole text, memory holds a piece of text and the tokens, and a bad byte is named where it is."""
from __future__ import annotations

import importlib
import re
import tracemalloc
from pathlib import Path

import pytest

from megaframe.data import long_text
from megaframe.data.indexed import DataError
from megaframe.data.long_text import encode_text_file, splits_text, text_pieces
from megaframe.data.tokenizer import ByteTokenizer, HFTokenizer

PIECE = 8192  # characters a piece in these tests: the files below are several pieces


def _corpus(lines: int = 6000) -> str:
    """Prose with what cuts must get right: multi-byte characters, Windows line ends, blank lines,
    lines that start or end with spaces, punctuation at line ends, a long line without a break."""
    words = ["the", "cat", "sat", "on", "mat", "naïve", "café", "日本語", "🙂", "don't", "x=1;", "3.14"]
    out = []
    for i in range(lines):
        line = " ".join(words[(i * 7 + k) % len(words)] for k in range(1 + i % 11))
        if i % 13 == 0:
            line = "  " + line
        if i % 17 == 0:
            line += ".  "
        out.append(line + ("\r\n" if i % 5 == 0 else "\n") + ("\n" if i % 29 == 0 else ""))
    out.insert(len(out) // 2, "y" * 20000 + "\n")
    return "".join(out)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(_corpus().encode("utf-8"))
    return path


def _bpe_dir(tmp_path: Path, prefix_space: str) -> Path:
    """A byte-level BPE (GPT-2's kind: pre_tokenizer "bytelevel") or a sentencepiece-like one that marks
    every text's start ("metaspace"), trained here on the corpus and saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    if prefix_space == "bytelevel":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet)
    backend.train_from_iterator(_corpus(300).splitlines(), trainer)
    directory = tmp_path / f"tokenizer-{prefix_space}"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)
    return directory


def _whole(tokenizer, path: Path) -> list[int]:
    """The tokens of the file read whole, as preprocessing read .txt files before pieces."""
    return tokenizer.encode(path.read_text(encoding="utf-8")) + [tokenizer.eod_id]


def _pieces_tokenized(monkeypatch, tokenizer) -> list[int]:
    """Records the length of each text the tokenizer is given beyond the cut checks' windows."""
    lengths: list[int] = []
    encode = tokenizer.encode

    def recording(text):
        if len(text) > 2 * long_text.CHECK_CHARS:
            lengths.append(len(text))
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return lengths


@pytest.mark.parametrize("kind", ["byte", "bytelevel"])
def test_a_file_of_many_pieces_gives_the_tokens_of_its_whole_text(kind, text_file, tmp_path, monkeypatch):
    tokenizer = ByteTokenizer() if kind == "byte" else HFTokenizer(_bpe_dir(tmp_path, kind))
    expected = _whole(tokenizer, text_file)
    lengths = _pieces_tokenized(monkeypatch, tokenizer)
    ids = encode_text_file(tokenizer, text_file, tokenizer.eod_id, chars=PIECE)
    assert ids.tolist() == expected
    # pieces of about 2 x PIECE, one larger around the 20,000-character line that has no cut in it
    assert len(lengths) >= 8 and max(lengths) < 45000 and sorted(lengths)[-2] < 25000, lengths


def test_a_tokenizer_that_marks_every_texts_start_is_cut_before_spaces_the_next_piece_drops(
        text_file, tmp_path, monkeypatch):
    """sentencepiece's dummy prefix (Llama 2's, Mistral's): cut before a space, the next piece starts
    after it, and the tokenizer's mark at its start stands where the space stood (it got its file
    whole: the tokenizer's objects for all of it, over 100 bytes a token)."""
    tokenizer = HFTokenizer(_bpe_dir(tmp_path, "metaspace"))
    assert long_text.cut_rule(tokenizer) == 1
    expected = _whole(tokenizer, text_file)
    lengths = _pieces_tokenized(monkeypatch, tokenizer)
    ids = encode_text_file(tokenizer, text_file, tokenizer.eod_id, chars=PIECE)
    assert ids.tolist() == expected
    assert len(lengths) >= 8 and max(lengths) < 45000 and sorted(lengths)[-2] < 25000, lengths
    pieces = list(long_text.cut_text(tokenizer, text_file, chars=PIECE))
    assert " ".join(pieces) == text_file.read_text(encoding="utf-8")


@pytest.mark.parametrize("kind", ["byte", "bytelevel"])
def test_text_without_a_break_or_a_space_is_cut_anywhere_the_tokenizer_agrees(kind, tmp_path, monkeypatch):
    """A genome or base64 as one .txt: no line break or space to cut at, so the whole file was held
    (100 MB of one run: 1.37 GB RSS). Cut anywhere the tokenizer agrees on: the byte tokenizer
    everywhere, a byte-level BPE where its merges allow; the tokens are the whole text's either way."""
    import random

    path = tmp_path / "genome.txt"
    path.write_text("".join(random.Random(5).choice("ACGT") for _ in range(30 * PIECE)), encoding="utf-8")
    tokenizer = ByteTokenizer() if kind == "byte" else HFTokenizer(_bpe_dir(tmp_path, kind))
    expected = _whole(tokenizer, path)
    lengths = _pieces_tokenized(monkeypatch, tokenizer)
    assert encode_text_file(tokenizer, path, tokenizer.eod_id, chars=PIECE).tolist() == expected
    if kind == "byte":
        assert len(lengths) >= 10 and max(lengths) < 3 * PIECE, lengths


class _MarksEveryTextWithAToken(ByteTokenizer):
    """Adds a token at the start of every text it is given (a BOS a tokenizer always adds): its tokens
    of two pieces are never the whole text's, whatever is dropped at the cut."""

    def encode(self, text: str) -> list[int]:
        return [255, *super().encode(text)]


def test_a_tokenizer_that_agrees_on_no_cut_gets_its_file_whole(text_file, monkeypatch):
    tokenizer = _MarksEveryTextWithAToken()
    assert long_text.cut_rule(tokenizer) is None and not splits_text(tokenizer)
    expected = _whole(tokenizer, text_file)
    lengths = _pieces_tokenized(monkeypatch, tokenizer)
    ids = encode_text_file(tokenizer, text_file, tokenizer.eod_id, chars=PIECE)
    assert ids.tolist() == expected and lengths == [len(text_file.read_text(encoding="utf-8"))]


class _NewlineJoinsTheNextWord:
    """A tokenizer whose tokens around a line break depend on both sides ("\\nword" is one token, but
    for the probe's word): cuts after line breaks disagree with the whole text, cuts before spaces
    agree. Its probe passes, so only the check at each cut keeps its tokens right."""

    name, vocab_size, eod_id = "joins", 1 << 20, 0

    def encode(self, text: str) -> list[int]:
        return [hash(token) % 1000003 + 1 for token in re.findall(r"\n(?!Three)\S+|\S+|\s", text)]


def test_each_cut_is_checked_on_the_files_own_text(text_file, monkeypatch):
    tokenizer = _NewlineJoinsTheNextWord()
    assert splits_text(tokenizer)
    expected = tokenizer.encode(text_file.read_text(encoding="utf-8")) + [0]
    assert encode_text_file(tokenizer, text_file, 0, chars=PIECE).tolist() == expected
    monkeypatch.setattr(long_text, "_agrees", lambda *_: True)  # cuts taken unchecked: other tokens
    assert encode_text_file(tokenizer, text_file, 0, chars=PIECE).tolist() != expected


def test_a_file_of_one_piece_is_tokenized_whole_as_before(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("one line\r\nand another\n", encoding="utf-8")
    ids = encode_text_file(ByteTokenizer(), path, None)
    assert bytes(ids.tolist()) == b"one line\nand another\n"


def test_a_bad_byte_is_named_at_its_offset_in_the_file(tmp_path):
    good = ("é" * 5000).encode("utf-8")  # two bytes a character: reads of 4,097 bytes cut some in two
    path = tmp_path / "bad.txt"
    path.write_bytes(good + b"\xff" + good)
    with pytest.raises(DataError, match=rf"not UTF-8 text \(byte {len(good)}\); convert it to UTF-8"):
        list(text_pieces(path, chars=4097))
    path.write_bytes(good + good)
    assert "".join(text_pieces(path, chars=4097)) == "é" * 10000


def test_memory_holds_the_tokens_not_the_text_in_python_objects(tmp_path):
    """The byte tokenizer's 4 MB file: at most 12 bytes a token at the peak (int32 pieces, then their
    concatenation, and a piece's list); tokenized whole it was a list of ints and an int64 copy (16)."""
    path = tmp_path / "large.txt"
    line = "abcdefghij klmnopqrst uvwxyz 0123456789\n"
    path.write_text(line * (4_000_000 // len(line)), encoding="utf-8")
    tokens = path.stat().st_size + 1
    tracemalloc.start()
    try:
        ids = encode_text_file(ByteTokenizer(), path, 256, chars=1 << 18)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids.size == tokens
    assert peak < 12 * tokens, f"peak {peak / tokens:.1f} bytes a token"


def test_preprocess_writes_a_large_file_in_pieces_on_workers_as_its_whole_text(tmp_path):
    """megaframe-preprocess's path: a 2.6 MB .txt (pieces of the default size, in a worker), a small one,
    and the held-out split of nanoGPT's prepare.py cut from the whole file's tokens."""
    from megaframe.data import open_dataset, preprocess

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(_corpus().encode("utf-8") * 12)
    (corpus / "b.txt").write_text("a small one\n", encoding="utf-8")
    whole = [_whole(ByteTokenizer(), corpus / name) for name in ("a.txt", "b.txt")]
    assert len(whole[0]) > 2 * long_text.PIECE_CHARS
    for workers in (1, 2):
        prefix = tmp_path / f"out{workers}" / "ds"
        preprocess([corpus], prefix, workers=workers, progress=False)
        dataset = open_dataset(prefix)
        assert [dataset[i].tolist() for i in range(len(dataset))] == whole
    train, valid = tmp_path / "split" / "train", tmp_path / "split" / "val"
    preprocess([corpus / "a.txt"], train, valid_fraction=0.1, valid_prefix=valid, progress=False)
    cut = int(0.9 * (len(whole[0]) - 1))
    assert open_dataset(train)[0].tolist() == whole[0][:cut] + [ByteTokenizer.eod_id]
    assert open_dataset(valid)[0].tolist() == whole[0][cut:]


def test_tasks_for_workers_hold_a_few_mb_of_text_or_one_large_file(tmp_path, monkeypatch):
    from megaframe.data.sources import TextFile

    module = importlib.import_module("megaframe.data.preprocess")  # the package exports its function

    monkeypatch.setattr(module, "_CHUNK_CHARS", 100)
    large = tmp_path / "large.txt"
    large.write_text("x" * 500, encoding="utf-8")
    documents = ["a" * 40, "b" * 40, "c" * 40, TextFile(large), "d" * 10, *["e"] * 70]
    chunks = list(module._chunks(documents))
    assert [(len(chunk), size) for chunk, size in chunks] == [(2, 80), (1, 40), (1, 500), (64, 73), (7, 7)]
    assert [doc for chunk, _ in chunks for doc in chunk] == documents


@pytest.mark.parametrize("kind, joiner", [("bytelevel", ""), ("metaspace", " ")])
def test_with_workers_a_large_file_is_cut_by_the_parent_and_tokenized_by_them_together(tmp_path, monkeypatch, kind,
                                                                                        joiner):
    """--workers N on one large .txt: the parent cuts it (checked cuts) and the workers tokenize the
    pieces, where one worker tokenized the whole file; the dataset is the whole text's tokens."""
    from megaframe.data import open_dataset, preprocess

    module = importlib.import_module("megaframe.data.preprocess")
    monkeypatch.setattr(module, "_CHUNK_CHARS", 20000)  # tasks of 20,000 characters: several pieces a task
    monkeypatch.setattr(long_text, "PIECE_CHARS", 4096)  # the parent's cuts: pieces of about 8 KiB
    path = tmp_path / "corpus.txt"
    path.write_bytes(_corpus().encode("utf-8"))
    tokenizer = HFTokenizer(_bpe_dir(tmp_path, kind))
    items = list(module._pieces([module.TextFile(path), "a short one"], tokenizer))
    assert len(items) > 10 and [item.last for item in items[:-1]] == [False] * (len(items) - 2) + [True]
    assert joiner.join(item.text for item in items[:-1]) == path.read_text(encoding="utf-8")
    assert items[-1] == "a short one"
    preprocess([path], tmp_path / "ds", tokenizer=str(tokenizer.name), workers=2, progress=False)
    assert open_dataset(tmp_path / "ds")[0].tolist() == _whole(tokenizer, path)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_large_file_in_pieces_splits_off_its_held_out_part_as_the_whole_text_would(tmp_path, monkeypatch, workers):
    """The pieces are written as they come (the document is never held whole) and nanoGPT's split is
    then cut from the written tokens: both datasets equal the whole text's tokens split at 90%."""
    from megaframe.data import open_dataset, preprocess

    module = importlib.import_module("megaframe.data.preprocess")
    monkeypatch.setattr(module, "_CHUNK_CHARS", 20000)  # the 0.4 MB corpus: a large file, cut by the parent
    monkeypatch.setattr(long_text, "PIECE_CHARS", 4096)
    path = tmp_path / "corpus.txt"
    path.write_bytes(_corpus().encode("utf-8"))
    whole = _whole(ByteTokenizer(), path)
    assert len(list(module._pieces([module.TextFile(path)], ByteTokenizer()))) > 20
    train, valid = tmp_path / "train", tmp_path / "val"
    preprocess([path], train, valid_fraction=0.1, valid_prefix=valid, workers=workers, progress=False)
    cut = int(0.9 * (len(whole) - 1))
    assert open_dataset(train)[0].tolist() == whole[:cut] + [ByteTokenizer.eod_id]
    assert open_dataset(valid)[0].tolist() == whole[cut:]
    open_dataset(train).verify()
    open_dataset(valid).verify()


@pytest.mark.parametrize("valid_fraction", [0.0, 0.1])
def test_preprocess_holds_a_piece_of_a_large_file_not_its_tokens(tmp_path, valid_fraction):
    """megaframe-preprocess's peak memory (tracemalloc) does not grow with a .txt's size: it held the
    document's tokens as int32 and their concatenation (8 bytes a token, 11 with the held-out split)."""
    from megaframe.data import preprocess

    line = "abcdefghij klmnopqrst uvwxyz 0123456789\n"
    peaks = []
    for megabytes in (8, 16):
        path = tmp_path / f"{megabytes}.txt"
        path.write_text(line * (megabytes * 1_000_000 // len(line)), encoding="utf-8")
        tracemalloc.start()
        try:
            preprocess([path], tmp_path / f"ds{megabytes}", valid_fraction=valid_fraction, progress=False)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] < 1.2 * peaks[0], f"peaks {[peak >> 20 for peak in peaks]} MiB at 8 and 16 MB"
    assert peaks[1] < 4 * 16_000_000, f"peak {peaks[1] >> 20} MiB for 16 M tokens"
