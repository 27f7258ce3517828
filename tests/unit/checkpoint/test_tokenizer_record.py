"""The tokenizer record: its hash follows the tokenizer files' content (only theirs), and two
records differ in the first field that tells them apart."""
from __future__ import annotations

from megaframe.checkpoint import tokenizer_record as records
from word_tokenizer import save_word_tokenizer, swap_words


def test_files_hash_follows_content_not_place_nor_other_files(tmp_path):
    first, second = save_word_tokenizer(tmp_path / "a"), save_word_tokenizer(tmp_path / "b")
    digest = records.files_hash(first)
    assert digest == records.files_hash(second)  # a copy elsewhere is the same tokenizer
    (first / "model.safetensors").write_bytes(b"weights")  # a model directory's other files do not count
    (first / "README.md").write_text("notes")
    assert records.files_hash(first) == digest
    swap_words(second)
    assert records.files_hash(second) != digest
    (second / "link").symlink_to(first / "tokenizer.json")  # not a tokenizer file name: ignored
    assert [p.name for p in records.tokenizer_files(first)] == ["tokenizer.json", "tokenizer_config.json"]


def test_difference_names_the_first_field_that_differs(tmp_path):
    directory = save_word_tokenizer(tmp_path / "tok")
    hf = records.hf_record(directory, 11, 1)
    byte = records.byte_record()
    assert records.difference(hf, dict(hf)) is None
    assert records.difference(byte, hf)[0] == "kind"
    assert records.difference(hf, {**hf, "eod_id": 0, "sha256": "x"}) == ("eod_id", 1, 0)
    assert records.difference(hf, {**hf, "sha256": "x"}) == ("sha256", hf["sha256"], "x")
    # an import whose tokenizer has no eos knows no ids: the hash alone decides
    assert records.difference({**hf, "vocab_size": None, "eod_id": None}, hf) is None
    assert records.is_record(hf) and records.is_record(byte)
    assert not records.is_record({"kind": "hf"}) and not records.is_record("byte")
    assert records.describe(byte) == "byte (vocabulary 257, end-of-document 256)"
    assert records.describe(hf) == f"{directory.resolve()} (vocabulary 11, end-of-document 1)"
