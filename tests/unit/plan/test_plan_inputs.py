"""Bad inputs the planner reads before launch are one line and exit code 2 in megaframe-plan and in
megaframe-train's pre-launch check (issue 50): a tokenizer directory that does not load (the usual way
to name a Megatron dataset's tokenizer) was a DataError traceback, a damaged sidecar (PREFIX.json)
a JSONDecodeError or AttributeError traceback."""
from __future__ import annotations

import json

import pytest

from megaframe.launch.checks import check
from megaframe.plan.cli import main as plan_main, preflight


def _tokenizer_dirs(root):
    """A directory that is empty, one whose tokenizer.json is broken, one with only a config naming
    a class that cannot load without files, and a plain file (not a directory)."""
    empty = root / "empty"
    empty.mkdir()
    broken = root / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    config_only = root / "config_only"
    config_only.mkdir()
    (config_only / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast"}))
    a_file = root / "tokenizer.json"
    a_file.write_text("{}")
    return {"empty": empty, "broken": broken, "config_only": config_only, "a_file": a_file}


@pytest.mark.parametrize("case", ["empty", "broken", "config_only", "a_file"])
def test_a_tokenizer_that_does_not_load_is_one_line_in_the_planner(case, tmp_path, capsys):
    tokenizer = _tokenizer_dirs(tmp_path)[case]
    with pytest.raises(SystemExit) as ended:
        plan_main([f"data.tokenizer={tokenizer}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-plan: error: data.tokenizer={tokenizer}") \
        or lines[0].startswith(f"megaframe-plan: error: data.tokenizer='{tokenizer}'"), lines[0]
    if case != "a_file":  # the pre-launch check of megaframe-train, which validation lets through
        cfg, layout, _ = check([f"data.tokenizer={tokenizer}"])
        with pytest.raises(SystemExit) as ended:
            preflight(cfg, layout, [], "megaframe-train")
        lines = capsys.readouterr().err.strip().splitlines()
        assert ended.value.code == 2 and len(lines) == 1 and f"data.tokenizer={tokenizer}" in lines[0], lines


SIDECARS = {"not-json": "{\"vocab_size\": 25", "a-list": "[257]", "vocab-a-string": '{"vocab_size": "257"}',
            "vocab-zero": '{"vocab_size": 0}', "not-utf8": b"\xff\xfe{}"}


@pytest.mark.parametrize("case", SIDECARS)
def test_a_damaged_sidecar_is_one_line_naming_it(case, tmp_path, capsys):
    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):  # present: validation looks for them first
        prefix.with_suffix(suffix).write_bytes(b"")
    meta = prefix.with_suffix(".json")
    content = SIDECARS[case]
    meta.write_bytes(content if isinstance(content, bytes) else content.encode())
    # the planner reads it for model.vocab_size=null, validation for a model.vocab_size to compare
    for args, prog in (([f"data.path={prefix}"], plan_main), ([f"data.path={prefix}", "model.vocab_size=300"], check)):
        with pytest.raises(SystemExit) as ended:
            prog(args)
        lines = capsys.readouterr().err.strip().splitlines()
        assert ended.value.code == 2 and len(lines) == 1, lines
        assert f"{meta}" in lines[0] and "megaframe-preprocess" in lines[0], lines[0]


@pytest.mark.parametrize("argv,expected", [
    (["-m", "parallel.tp=1,2"], "-m: megaframe-plan plans one layout; parallel=auto ranks the layouts that fit"),
    (["--multirun"], "--multirun: megaframe-plan plans one layout"),
    (["parallel.tp=2", "--dry-run", "0"], "--dry-run: not an option; megaframe-plan takes --json, --dry-run=RANK"),
])
def test_a_flag_the_planner_does_not_take_is_one_line_naming_it(argv, expected, capsys):
    """Hydra's override lexer met them: "LexerNoViableAltException: -m ^ See https://hydra.cc/..."."""
    with pytest.raises(SystemExit) as ended:
        plan_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-plan: error: {expected}"), lines


def test_the_config_dir_flag_still_reaches_the_planner(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("defaults:\n  - gpt_tiny\n  - _self_\nnum_layers: 3\n")
    plan_main(["--json", "--config-dir", str(tmp_path), "model=mine"])
    assert json.loads(capsys.readouterr().out)["plan"]["stages"][0]["blocks"] == 3  # gpt_tiny has 4
