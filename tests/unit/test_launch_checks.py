"""Before launch (megaframe/launch/checks.py): the built-in corpus's cache must be usable. It is
written after launch, and a cache that could not be made ended rank 0 with NotADirectoryError or
FileNotFoundError (exit 1), naming no setting."""
from __future__ import annotations

from megaframe.launch.checks import demo_cache_problem


def test_a_cache_that_cannot_be_made_names_the_setting_that_chose_it(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    problem = demo_cache_problem(str(tmp_path / "a_file" / "cache"))
    assert problem == (f"the built-in corpus is cached in {tmp_path / 'a_file' / 'cache'} (data.cache_dir), which "
                       f"cannot be used (Not a directory); set data.cache_dir to a folder you can write, or train "
                       f"on your own data with data.path")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))
    assert "(XDG_CACHE_HOME), which cannot be used (Not a directory)" in demo_cache_problem(None)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "a_file"))
    assert "(HOME), which cannot be used" in demo_cache_problem(None)


def test_a_usable_cache_passes_and_is_made(tmp_path, monkeypatch):
    assert demo_cache_problem(str(tmp_path / "new" / "cache")) is None and (tmp_path / "new" / "cache").is_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_cache_problem(None) is None and (tmp_path / "xdg" / "megaframe").is_dir()


def test_a_read_only_cache_that_holds_the_corpus_is_fine(tmp_path, monkeypatch):
    """Only its build writes: a shared cache made read-only after the corpus was built trains as before."""
    import os

    from megaframe.data.demo import DEMO_BYTES, demo_cache_key

    # built: ensure_demo_dataset's directory appears only by the rename of a finished build
    (tmp_path / "cache" / demo_cache_key(DEMO_BYTES)).mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as a read-only folder answers (root's never does)
    assert demo_cache_problem(str(tmp_path / "cache")) is None
    assert "which cannot be used (not writable)" in demo_cache_problem(str(tmp_path / "other"))
