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


def test_a_fast_tier_directory_without_room_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    """A container's /dev/shm is 64 MB unless docker --shm-size says more: the first fast save failed
    with exit 8 minutes into the run. The room the ranks need is the planner's (plan/host.py)."""
    import shutil
    from collections import namedtuple

    import pytest

    from megaframe.launch.checks import check, check_before_launch, fast_tier_space_problem
    from megaframe.plan.estimate import estimate_config

    fast = [f"train.fast_save_dir={tmp_path / 'shm' / 'megaframe'}", "train.fast_save_interval=5",
            "parallel.dp=2", "zero=stage1", f"hydra.run.dir={tmp_path / 'run'}"]
    cfg, layout, run_dir = check(fast)
    need = 2 * estimate_config(cfg, layout).host.fast_tier  # two ranks on this host
    assert need > 0 and fast_tier_space_problem(cfg, layout, run_dir) is None  # this disk has room
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, int(need) - 1))
    with pytest.raises(SystemExit) as ended:
        check_before_launch(cfg, layout, run_dir)
    lines = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megaframe-train: error: train.fast_save_dir={tmp_path / 'shm' / 'megaframe'}: "), lines
    assert f"in {tmp_path}" in lines[0] and "2 ranks x 4 checkpoint parts" in lines[0], lines
    assert "docker --shm-size" in lines[0] and "train.fast_save_interval=0" in lines[0], lines
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, int(need)))
    assert fast_tier_space_problem(cfg, layout, run_dir) is None  # exactly enough
    # a restart: this run's parts from the attempt before are there, and the new ones replace them
    from megaframe.checkpoint.fast_tier import run_key

    old_parts = tmp_path / "shm" / "megaframe" / run_key(tmp_path / "run") / "global_step5" / "rank0"
    old_parts.mkdir(parents=True)
    (old_parts / "part.safetensors").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64 << 20, 0, int(need) - 4096))
    assert fast_tier_space_problem(cfg, layout, run_dir) is None
    elastic, elastic_layout, elastic_dir = check([*fast, "launcher.min_nodes=1", "launcher.nodes=2",
                                                  "cluster.gpus_per_node=2", "parallel.dp=null",
                                                  "parallel.global_batch_size=32"])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, 0))
    # this host prints an elastic job's node command, and may not be one of its nodes: not checked here
    assert fast_tier_space_problem(elastic, elastic_layout, elastic_dir) is None
    cfg, layout, _ = check([*fast, "train.fast_save_interval=0"])
    assert fast_tier_space_problem(cfg, layout, run_dir) is None  # no fast tier: nothing kept there


def test_a_run_dir_on_a_full_disk_is_refused_before_launch(tmp_path, monkeypatch):
    """The resume command a full disk's exit 8 prints, run before freeing space, wrote config.yaml
    first: a Hydra traceback, exit 1 (review). Asked of the nearest folder that exists."""
    import shutil
    from collections import namedtuple

    from megaframe.launch import checks

    usage = namedtuple("usage", "total used free")
    asked = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: asked.append(path) or usage(10 << 20, 10 << 20, 4096))
    run_dir = tmp_path / "runs" / "new"
    assert checks.run_dir_space_problem(str(run_dir)) == (
        f"run dir {run_dir}: its disk has 4,096 bytes free, too few for the run's first files; free space there "
        f"(train.resume=auto then continues from the newest checkpoint) or choose another run dir (hydra.run.dir=...)")
    assert asked == [tmp_path]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, 8 << 20, 2 << 20))
    assert checks.run_dir_space_problem(str(run_dir)) is None
