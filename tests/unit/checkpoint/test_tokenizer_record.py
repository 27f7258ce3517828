"""The tokenizer record: its hash follows the tokenizer files' content (only theirs), and two
records differ in the first field that tells them apart."""
from __future__ import annotations

from megaframe.checkpoint import tokenizer_record as records
from megaframe.common import tokenizer_files
from tests.support.word_tokenizer import save_word_tokenizer, swap_words


def test_files_hash_follows_content_not_place_nor_other_files(tmp_path):
    first, second = save_word_tokenizer(tmp_path / "a"), save_word_tokenizer(tmp_path / "b")
    digest = tokenizer_files.files_hash(first)
    assert digest == tokenizer_files.files_hash(second)  # a copy elsewhere is the same tokenizer
    (first / "model.safetensors").write_bytes(b"weights")  # a model directory's other files do not count
    (first / "README.md").write_text("notes")
    assert tokenizer_files.files_hash(first) == digest
    swap_words(second)
    assert tokenizer_files.files_hash(second) != digest
    (second / "link").symlink_to(first / "tokenizer.json")  # not a tokenizer file name: ignored
    assert [p.name for p in tokenizer_files.tokenizer_files(first)] == ["tokenizer.json", "tokenizer_config.json"]


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


def test_hash_ignores_what_save_pretrained_rewrites_by_version_and_scheme_1_is_the_old_hash(tmp_path):
    """tokenizer_config.json and special_tokens_map.json hold keys of the transformers version that
    saved them: re-saving the same tokenizer elsewhere must not change the hash; scheme 1 (records of
    checkpoints written before) stays the hash of every tokenizer file, byte for byte as it was."""
    import hashlib

    directory = save_word_tokenizer(tmp_path / "tok")
    digest, old = tokenizer_files.files_hash(directory), tokenizer_files.files_hash(directory, 1)
    expected_old = hashlib.sha256()
    for path in tokenizer_files.tokenizer_files(directory):
        expected_old.update(f"{path.name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    assert old == expected_old.hexdigest() and old != digest
    config = directory / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"transformers_version": "9.9.9", ', 1))
    (directory / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    assert tokenizer_files.files_hash(directory) == digest  # the same mapping of ids to text
    assert tokenizer_files.files_hash(directory, 1) != old
    record = records.hf_record(directory, 11, 1)
    assert record["hash_scheme"] == records.HASH_SCHEME and record["sha256"] == digest
    swap_words(directory)  # the mapping itself: still counts
    assert tokenizer_files.files_hash(directory) != digest


def test_a_record_of_the_old_scheme_is_compared_under_it(tmp_path):
    directory = save_word_tokenizer(tmp_path / "tok")
    current = records.hf_record(directory, 11, 1)
    old = {key: value for key, value in current.items() if key != "hash_scheme"}
    old["sha256"] = tokenizer_files.files_hash(directory, 1)
    assert records.scheme_of(old) == 1 and records.difference(old, current) is not None
    assert records.difference(old, records.under_scheme(current, old)) is None
    assert records.under_scheme(current, current) is current
    assert records.under_scheme(records.byte_record(), old)["kind"] == "byte"
    for edited in ([1], "1", True, 99):  # an edited state.json: the current scheme, never a TypeError
        assert records.scheme_of({**old, "hash_scheme": edited}) == records.HASH_SCHEME
