"""The fast tier's bookkeeping in one process (the buddy exchange and a lost node are in
tests/e2e/test_elastic.py): a part is usable only once done, memory holds the newest part only,
a part that does not verify is not published, and a restore publishes a normal checkpoint."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from megaframe.checkpoint import universal
from megaframe.checkpoint import store as checkpoint
from megaframe.checkpoint.fast_tier import FastTier, _complete_steps, _pack, _unpack, buddies, run_key


def _writer(step: int):
    """A rank's part as a real save writes it: a shard file, its record, rank 0's state.json."""
    def write(part: Path) -> dict:
        (part / "shards").mkdir(parents=True, exist_ok=True)
        shard = part / "shards" / "rank00000.safetensors"
        shard.write_bytes(b"weights of step %d" % step)
        universal.write_state(part, {"step": step, "consumed_samples": 0, "model": {}, "version": universal.SHARDED_VERSION})
        return {"rank": 0, "files": {"shards/rank00000.safetensors": universal.file_entry(shard)}, "tensors": {}}
    return write


def _tier(tmp_path: Path) -> FastTier:
    return FastTier(tmp_path / "shm", tmp_path / "run", rank=0, world=1)


def test_only_the_newest_done_part_is_kept(tmp_path):
    tier = _tier(tmp_path)
    for step in (1, 2, 3):
        tier.save(step, _writer(step))
    assert sorted(tier.inventory()) == [3]
    assert [p.name for p in tier.dir.iterdir()] == ["global_step3"]
    marker = tier.inventory()[3][0]
    assert marker["world"] == 1 and marker["copy"] == "own"
    assert set(marker["files"]) == {"shards/rank00000.safetensors", "shards/rank00000.json", "state.json"}
    tier.clear()
    assert tier.inventory() == {}


def test_a_part_without_its_done_marker_is_not_there(tmp_path):
    tier = _tier(tmp_path)
    tier.save(4, _writer(4))
    (tier.dir / "global_step4" / "rank0.done.json").unlink()  # a crash before the marker
    assert tier.inventory() == {}


def test_restore_publishes_a_checkpoint_the_normal_resume_loads(tmp_path):
    tier, save_dir = _tier(tmp_path), tmp_path / "run" / "checkpoints"
    tier.save(7, _writer(7))
    line = tier.restore(save_dir, 5, lambda tmp, step, world: checkpoint.publish_dir(tmp, save_dir, step, world))
    assert line == ("restored global_step7 from node-local memory (newer than the shared checkpoint of step 5): "
                    "the parts of rank 0 from their own node")
    assert checkpoint.find_latest(save_dir) == save_dir / "global_step7"
    assert checkpoint.manifest_problem(save_dir / "global_step7") is None
    assert universal.read_state(save_dir / "global_step7")["step"] == 7
    assert tier.inventory() == {}  # on shared storage now: the node's copy is dropped


def test_nothing_newer_than_the_shared_checkpoint_is_restored(tmp_path):
    tier, save_dir = _tier(tmp_path), tmp_path / "checkpoints"
    tier.save(7, _writer(7))
    assert tier.restore(save_dir, 7, lambda *a: None) is None
    assert not save_dir.exists()


def test_a_part_that_does_not_verify_is_not_published(tmp_path):
    tier, save_dir = _tier(tmp_path), tmp_path / "checkpoints"
    tier.save(7, _writer(7))
    (tier.dir / "global_step7" / "rank0" / "shards" / "rank00000.safetensors").write_bytes(b"weights of step 6")
    published = []
    assert tier.restore(save_dir, 5, lambda *a: published.append(a)) is None
    assert published == [] and not (save_dir / "tmp-global_step7").exists()


def _marker(step: int, rank: int, world: int, copy: str) -> dict:
    return {"step": step, "rank": rank, "world": world, "copy": copy, "files": {}}


def test_a_step_is_complete_only_when_the_nodes_together_hold_every_rank():
    # three ranks on three nodes, node 2 lost: nodes 0 and 1 hold ranks 0 and 1 and the buddy copy
    # of rank 2 (on node 0: rank 2's buddy is rank 0); step 9's copy of rank 2 never arrived
    node0 = {8: {0: _marker(8, 0, 3, "own"), 2: _marker(8, 2, 3, "buddy")}, 9: {0: _marker(9, 0, 3, "own")}}
    node1 = {8: {1: _marker(8, 1, 3, "own"), 0: _marker(8, 0, 3, "buddy")}, 9: {1: _marker(9, 1, 3, "own")}}
    found = list(_complete_steps([node0, node1], shared_step=5))
    assert [step for step, _, _ in found] == [8]
    _, holders, world = found[0]
    assert world == 3 and {rank: holder for rank, (holder, _) in holders.items()} == {0: 0, 1: 1, 2: 0}
    assert holders[0][1]["copy"] == "own"  # node 0's own copy of rank 0, not node 1's buddy copy
    assert list(_complete_steps([node0, node1], shared_step=8)) == []


def test_every_node_names_a_run_alike():
    assert run_key(Path("/shared/run")) == run_key(Path("/shared/run/"))
    assert run_key(Path("/shared/run")) != run_key(Path("/shared/run2"))


def test_the_marker_is_json_a_person_can_read(tmp_path):
    tier = _tier(tmp_path)
    tier.save(2, _writer(2))
    text = (tier.dir / "global_step2" / "rank0.done.json").read_text()
    assert json.loads(text)["step"] == 2


def test_each_rank_has_a_buddy_on_the_next_node_whatever_the_node_sizes():
    assert buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]  # two nodes of two ranks
    assert buddies(["a", "b", "c"]) == [1, 2, 0]  # three nodes of one rank (the elastic tests)
    assert buddies(["a", "a", "a"]) == [None, None, None]  # one node: no copy elsewhere
    # Ray's placement: ranks 0 and 1 on the head, rank 2 alone on the second node; every rank's copy
    # lands on the other node, and rank 2 keeps the copies of both head ranks
    assert buddies(["head", "head", "b"]) == [2, 2, 0]
    # ranks of a node need not be numbered contiguously
    assert buddies(["a", "b", "a", "b"]) == [1, 0, 3, 2]


def test_a_planted_or_foreign_done_marker_is_not_a_part(tmp_path):
    """Node-local memory may be shared: a marker that is a link (to a big or secret file) or holds
    other JSON is passed over, neither read through nor a traceback."""
    tier = _tier(tmp_path)
    tier.save(5, _writer(5))
    step_dir = tier.dir / "global_step5"
    (tmp_path / "victim").write_text(json.dumps({"step": 5, "rank": 1, "world": 2}))
    (step_dir / "rank1.done.json").symlink_to(tmp_path / "victim")
    (step_dir / "rank2.done.json").write_text(json.dumps({"step": "five", "rank": []}))
    (step_dir / "rank3.done.json").write_text(json.dumps(["not", "a", "marker"]))
    assert sorted(tier.inventory()[5]) == [0]


class _Fast:
    def __init__(self):
        self.cleared = False

    def clear(self):
        self.cleared = True


@pytest.mark.parametrize("fails", [False, True])
def test_the_run_end_clears_the_fast_tier_only_once_the_last_save_is_published(fails):
    """The node-local parts may be newer than the last good shared checkpoint: a final async save that
    fails (a full disk) must leave them, and its error still reaches close() (exit 8). They were
    cleared before the save in flight was waited for."""
    from types import SimpleNamespace

    from megaframe.checkpoint.manager import CheckpointManager
    from megaframe.checkpoint.store import BackgroundWriter

    manager = CheckpointManager.__new__(CheckpointManager)  # only what finished() reads
    manager.fast, manager.background = _Fast(), BackgroundWriter()
    manager.cfg = SimpleNamespace(train=SimpleNamespace(max_steps=10))
    released = threading.Event()

    def final_save():
        released.wait(5)
        if fails:
            raise OSError(28, "No space left on device")
    manager.background.submit(final_save, "global_step10")
    threading.Timer(0.2, released.set).start()
    manager.finished(10)
    assert manager.fast.cleared is not fails
    if fails:
        with pytest.raises(Exception, match="global_step10"):
            manager.wait()
    else:
        manager.wait()


class _Stop(Exception):
    """Where the stub resume stops: past the fast-tier decision, before a checkpoint would be read."""


@pytest.mark.parametrize("resume,cleared", [("none", True), ("a checkpoint that is there", True),
                                            ("a mistyped path", False)])
def test_a_resume_that_leaves_the_runs_own_steps_clears_the_fast_tier_a_mistyped_path_does_not(
        tmp_path, monkeypatch, resume, cleared):
    """train.resume=none, or a PATH that is there: the node's parts of the run's other steps are no
    longer its own, and a later resume=auto must not publish them over the new timeline. A PATH that
    is not there fails the run, which must leave them for the next try."""
    from types import SimpleNamespace

    from megaframe.checkpoint import manager as manager_module
    from megaframe.checkpoint.manager import CheckpointManager

    there = tmp_path / "elsewhere" / "global_step4"
    there.mkdir(parents=True)
    value = {"none": "none", "a checkpoint that is there": str(there),
             "a mistyped path": str(tmp_path / "elsewhere" / "global_step44")}[resume]
    manager = CheckpointManager.__new__(CheckpointManager)  # only what resume() reads before a load
    manager.fast, manager.is_logger, manager.whole, manager._engine_parts = _Fast(), True, [], (0, 0)
    manager.run_dir, manager.dir = tmp_path, tmp_path / "checkpoints"
    manager.metrics, manager.dims, manager.layout = None, None, SimpleNamespace(world_size=1)
    manager.cfg = SimpleNamespace(train=SimpleNamespace(resume=value))

    def stop(*args, **kwargs):
        raise _Stop
    monkeypatch.setattr(manager_module.resume_checks, "start_over", stop)
    monkeypatch.setattr(manager_module.store, "check_model_shape", stop)
    with pytest.raises(_Stop):
        manager.resume()
    assert manager.fast.cleared is cleared


def test_the_run_directory_on_the_node_is_private_and_a_foreign_one_is_refused(tmp_path, monkeypatch):
    """Node-local memory is every user's and a run's directory name is predictable: the tier makes its
    directory 0700, tightens one of this user's that others could only read, and refuses (exit 8, one
    line) one that is a link, writable by others, or another user's, writing and restoring nothing."""
    import os
    import stat

    from megaframe.common.failures import ExitCode, SaveFailed

    tier = _tier(tmp_path)
    assert stat.S_IMODE(os.lstat(tier.dir).st_mode) == 0o700
    os.chmod(tier.dir, 0o755)  # an older megaframe's: readable by others, writable by nobody else
    assert stat.S_IMODE(os.lstat(_tier(tmp_path).dir).st_mode) == 0o700

    def refusal() -> str:
        with pytest.raises(SaveFailed) as caught:
            _tier(tmp_path)
        assert caught.value.exit_code == ExitCode.SAVE_FAILED and "\n" not in str(caught.value)
        return str(caught.value)

    os.chmod(tier.dir, 0o777)
    assert "writable by others (mode 777)" in refusal()
    os.chmod(tier.dir, 0o700)
    owner = os.lstat(tier.dir).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    assert "owned by uid" in refusal()
    monkeypatch.undo()
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: os.stat_result((*real_stat(p)[:4], 4242, *real_stat(p)[5:]))
                        if Path(p) == tier.dir.parent else real_stat(p, *a, **k))
    assert "owned by uid 4242, who could swap" in refusal()  # the folder it is made in
    monkeypatch.undo()
    tier.dir.rmdir()
    (tmp_path / "elsewhere").mkdir()
    tier.dir.symlink_to(tmp_path / "elsewhere")
    assert "is a link" in refusal() and "train.fast_save_dir" in refusal()


def test_a_save_after_a_restore_makes_the_directory_private_again(tmp_path):
    """A restore (and a finished run) removes the run's directory; the next save makes it again,
    private, and refuses one another user made in the meantime."""
    import os
    import stat

    from megaframe.common.failures import SaveFailed

    tier, save_dir = _tier(tmp_path), tmp_path / "run" / "checkpoints"
    tier.save(7, _writer(7))
    assert tier.restore(save_dir, 5, lambda tmp, step, world: checkpoint.publish_dir(tmp, save_dir, step, world))
    assert not tier.dir.exists()
    tier.save(8, _writer(8))
    assert stat.S_IMODE(os.lstat(tier.dir).st_mode) == 0o700
    tier.clear()
    tier.dir.mkdir(mode=0o777)
    os.chmod(tier.dir, 0o777)  # made by someone else while the run went on: writable by all
    with pytest.raises(SaveFailed):
        tier.save(9, _writer(9))


def test_a_marker_naming_a_file_outside_its_part_is_not_published(tmp_path):
    """A done marker whose files include ../ (a node's other file, which its own sha256 verifies) is
    not restored: the copy would put that file into the checkpoint."""
    tier, save_dir = _tier(tmp_path), tmp_path / "checkpoints"
    tier.save(7, _writer(7))
    (tmp_path / "secret").write_text("not the run's")
    done = tier.dir / "global_step7" / "rank0.done.json"
    marker = json.loads(done.read_text())
    marker["files"]["../../../../secret"] = universal.file_entry(tmp_path / "secret")  # part -> tmp_path
    done.write_text(json.dumps(marker))
    published = []
    assert tier.restore(save_dir, 5, lambda *a: published.append(a)) is None
    assert published == [] and not list(save_dir.rglob("secret"))


def test_a_buddys_payload_is_written_only_when_it_is_the_senders_whole_part_inside_its_folder(tmp_path):
    """What a rank receives from its sender is checked before a byte is written: the sender's rank,
    names inside rank{sender}/, and files that fill the payload exactly. A refusal leaves the copy
    it already held (and its done marker) as they were."""
    from megaframe.common.failures import SaveFailed

    tier = _tier(tmp_path)
    tier.save(3, _writer(3))
    step_dir = tier.dir / "global_step3"
    part = step_dir / "rank0"
    marker = json.loads((step_dir / "rank0.done.json").read_text())
    marker.pop("copy")
    into = tmp_path / "buddy" / "global_step3"
    into.mkdir(parents=True)

    received = _unpack(_pack(part, marker), into, sender=0)  # the sender's own part: copied byte for byte
    assert received["files"] == marker["files"]
    assert all((into / "rank0" / rel).read_bytes() == (part / rel).read_bytes() for rel in marker["files"])
    (into / "rank0.done.json").write_text("{}")  # the copy a later bad payload must not touch
    held = {rel: (into / "rank0" / rel).read_bytes() for rel in marker["files"]}

    def refused(payload, sender: int = 0) -> str:
        with pytest.raises(SaveFailed) as err:
            _unpack(payload, into, sender=sender)
        assert (into / "rank0.done.json").exists(), "a refused payload removed the copy already held"
        assert {rel: (into / "rank0" / rel).read_bytes() for rel in marker["files"]} == held
        return str(err.value)

    assert "says rank 0" in refused(_pack(part, marker), sender=1)  # another rank's part
    (tmp_path / "buddy" / "secret").write_text("not the run's")
    secret = universal.file_entry(tmp_path / "buddy" / "secret")
    outside = {**marker, "files": {**marker["files"], "../../secret": secret}}
    (tier.dir / "secret").write_text("not the run's")  # what _pack reads at part/../../secret
    assert "outside" in refused(_pack(part, outside))
    assert (tmp_path / "buddy" / "secret").read_text() == "not the run's"
    whole = _pack(part, marker)
    assert "torn" in refused(whole[:-5])


def test_parts_left_by_a_deleted_run_dir_of_the_same_path_are_not_restored(tmp_path):
    """The node's folder is named by the run dir's path: a run killed at step 7, its run dir deleted
    and a new run started at the same path with train.resume=auto, restored and resumed the old
    run's step 7 (found by a review). Parts carry the run dir's lineage token now; another
    lineage's are not restored, and are cleared."""
    import shutil

    old = _tier(tmp_path)
    old.save(7, _writer(7))
    assert (tmp_path / "run" / ".fast_tier_lineage").is_file()
    again = _tier(tmp_path)  # a later attempt of the same run: the same lineage, its parts restore
    assert again.lineage == old.lineage and sorted(again.inventory()) == [7]
    shutil.rmtree(tmp_path / "run")
    fresh = _tier(tmp_path)
    assert fresh.lineage != old.lineage and fresh.dir == old.dir
    published = []
    assert fresh.restore(tmp_path / "run" / "checkpoints", 0, lambda *a: published.append(a)) is None
    assert published == [] and not fresh.dir.exists()


def test_a_save_drops_the_newer_steps_a_rolled_back_run_left(tmp_path):
    """After train.resume=PATH went back to an earlier checkpoint, the abandoned timeline's newer
    parts stayed on the node (only older steps were dropped) and a later restore could publish
    them over the new timeline. A save keeps its own step alone."""
    tier = _tier(tmp_path)
    tier.save(10, _writer(10))
    tier.save(6, _writer(6))  # the run went back and trained on from step 5
    assert sorted(tier.inventory()) == [6]
    assert [p.name for p in tier.dir.iterdir()] == ["global_step6"]


def test_a_save_leaves_the_next_step_a_node_mate_began_while_it_waited(tmp_path):
    """A node-mate past this save's barrier may begin the next save before this rank's drop runs:
    its `global_step{N+1}` folder, still empty an instant after its mkdir, went under it when the
    newer steps were dropped after the barrier (FileNotFoundError in CI). Here the folder appears
    while this rank writes its part, after the save's first drop and before its barrier."""
    tier = _tier(tmp_path)
    write = _writer(2)

    def write_while_a_node_mate_begins_step_3(part: Path) -> dict:
        (tier.dir / "global_step3").mkdir()  # the node-mate's mkdir(parents=True), before its own part
        return write(part)

    tier.save(2, write_while_a_node_mate_begins_step_3)
    assert (tier.dir / "global_step3").is_dir() and sorted(tier.inventory()) == [2]


def test_a_run_dir_that_cannot_keep_the_token_is_a_refusal_not_a_traceback(tmp_path):
    """Rank 0 reads or makes the lineage token while the other ranks wait for it in a broadcast: an
    OSError there (a read-only run dir) is the same SaveFailed line on every rank."""
    from megaframe.common.failures import SaveFailed

    (tmp_path / "run").write_text("a file where the run dir should be")
    with pytest.raises(SaveFailed) as err:
        FastTier(tmp_path / "shm", tmp_path / "run", rank=0, world=1)
    assert ".fast_tier_lineage" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("damaged", [True, False])
def test_the_nodes_older_step_is_restored_when_the_newest_shared_checkpoint_is_damaged(tmp_path, monkeypatch,
                                                                                      damaged):
    """The fast tier skips the save steps: after the save of step 6 the nodes hold step 5 until the
    next fast save. The floor was the step `latest` names, verified or not: with global_step6 damaged
    the nodes' step 5 was dropped and the resume fell back to global_step2, three steps lost. Now it
    is restored; with global_step6 whole, the resume takes 6 and hashes it once, as before."""
    from types import SimpleNamespace

    from megaframe.checkpoint import manager as manager_module
    from megaframe.checkpoint.manager import CheckpointManager

    run_dir = tmp_path / "run"
    save_dir = run_dir / "checkpoints"
    tier = FastTier(tmp_path / "shm", run_dir, rank=0, world=1)
    for step in (2, 6):
        tmp = save_dir / f"tmp-global_step{step}"
        (tmp / "shards").mkdir(parents=True)
        (tmp / "shards" / "rank00000.json").write_text(json.dumps(_writer(step)(tmp)))
        checkpoint.publish_dir(tmp, save_dir, step, 1)
    tier.save(5, _writer(5))
    if damaged:
        (save_dir / "global_step6" / "shards" / "rank00000.safetensors").write_bytes(b"bit rot of step 6")
    manager = CheckpointManager.__new__(CheckpointManager)  # only what resume() reads before a load
    manager.fast, manager.is_logger, manager.whole, manager._engine_parts = tier, True, [], (0, 0)
    manager.trash, manager.dims = checkpoint.TrashCollector(), None
    manager.run_dir, manager.dir = run_dir, save_dir
    manager.cfg = SimpleNamespace(train=SimpleNamespace(resume="auto", keep_checkpoints=0))
    resumed, hashed, verify = [], [], checkpoint.manifest_problem

    def counting(path):
        hashed.append(Path(path).name)
        return verify(path)
    monkeypatch.setattr(manager_module.store, "manifest_problem", counting)

    def stop(path, dims):
        resumed.append(path)
        raise _Stop
    monkeypatch.setattr(manager_module.store, "check_model_shape", stop)
    with pytest.raises(_Stop):
        manager.resume()
    if damaged:
        assert resumed == [save_dir / "global_step5"]
        assert (save_dir / "global_step5" / "shards" / "rank00000.safetensors").read_bytes() == b"weights of step 5"
    else:
        assert resumed == [save_dir / "global_step6"] and hashed == ["global_step6"]
    assert tier.inventory() == {}  # published, or older than what the resume takes


def test_a_node_s_ranks_share_restoring_its_parts():
    # two nodes of four ranks, each rank listing its node's four own parts and the other node's four
    # buddy copies: each part is restored by its own rank, none by the node's lowest rank alone
    node = lambda first: {6: {r: _marker(6, r, 8, "own" if first <= r < first + 4 else "buddy")  # noqa: E731
                              for r in range(8)}}
    everyone = [node(0)] * 4 + [node(4)] * 4
    (_, holders, world), = _complete_steps(everyone, shared_step=0)
    assert world == 8 and {rank: holder for rank, (holder, _) in holders.items()} == {r: r for r in range(8)}
    # node 1 lost, its ranks now on node 0's four: the buddy copies of 4..7 spread over node 0's ranks
    (_, holders, _), = _complete_steps([node(0)] * 4, shared_step=0)
    assert {rank: holder for rank, (holder, _) in holders.items()} == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3}
    assert all(holders[r][1]["copy"] == ("own" if r < 4 else "buddy") for r in range(8))


def test_buddy_copies_whose_ranks_share_a_stride_with_the_holders_still_spread():
    # old ranks 4, 8, 12 and 16 (a stride of 4) restored by four ranks that list only buddy copies of them
    parts = {r: _marker(6, r, 20, "own" if r < 4 else "buddy") for r in (0, 1, 2, 3, 4, 8, 12, 16)}
    parts.update({r: _marker(6, r, 20, "own") for r in range(20) if r not in parts})
    everyone = [{6: {r: m for r, m in parts.items() if r in (0, 1, 2, 3, 4, 8, 12, 16)}}] * 4
    everyone += [{6: {r: m for r, m in parts.items() if r not in (0, 1, 2, 3, 4, 8, 12, 16)}}] * 16
    (_, holders, _), = _complete_steps(everyone, shared_step=0)
    assert sorted(holders[r][0] for r in (4, 8, 12, 16)) == [0, 1, 2, 3], holders
