"""The fast checkpoint tier (train.fast_save_interval): each rank's latest part of a layout-free
checkpoint in node-local memory, mirrored to a buddy rank on another node.

Why: an elastic job (docs/elastic.md) redoes the work since its last checkpoint whenever a node is
lost, and a checkpoint per step on shared storage is 16Ψ/N bytes per rank per step (about 112 GB a
step for 7B on 64 GPUs). Here each rank writes its part (the same files it writes into a shared
checkpoint: its shard, its RNG states, and on rank 0 state.json) to train.fast_save_dir, on the
node (/dev/shm by default: memory, and it outlives a worker restart), then sends it to its buddy,
rank + ranks-per-node, which is on the next node. Losing one node loses no part: each of its ranks'
parts is also on the next node.

Layout on each node, under FAST_DIR/<run key>/:
  global_step{N}/rank{R}/...        rank R's part of step N, files at their checkpoint paths
  global_step{N}/rank{R}.done.json  written last (atomic): the part's files, sizes and sha256, the
                                    world size of step N, and whether this node wrote it or holds
                                    a buddy's copy
Each rank keeps its newest part and the newest it received, and deletes older ones only once every
rank has its part and its copies of the new step (a barrier of the gloo group): memory is one step
per rank plus its buddy copies (two steps while a new one is written).

Restore (an attempt starting with train.resume=auto): every rank lists the complete parts on its
node; the ranks gather the lists; the newest step newer than the shared checkpoint whose parts
cover every rank of its world is verified and copied by one holder per part into
checkpoints/tmp-global_step{N}/ on shared storage, and rank 0 publishes it as a normal checkpoint,
which the attempt then resumes from (into any layout). So a lost node costs at most the step in
flight, and the shared checkpoints keep their own, longer interval.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaframe.common import json_text
from megaframe.common.atomic_io import atomic_write_text, fsync_file
from megaframe.common.failures import SaveFailed
from megaframe.checkpoint import universal
from megaframe.checkpoint.sharded import write_record
from megaframe.common.safe_files import read_capped
from megaframe.parallel.rank_zero import decided_by_rank_zero

_STEP_DIR = re.compile(r"global_step(\d+)")
_DONE = re.compile(r"rank(\d+)\.done\.json")


def run_key(run_dir: Path) -> str:
    """The node-local directory name of one run: every node derives the same from the shared run dir."""
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class FastTier:
    """One rank's side of the fast tier: save(step) at a step boundary, restore() before resuming."""

    def __init__(self, root: Path, run_dir: Path, rank: int, world: int, timeout: Optional[timedelta] = None):
        self.dir = Path(root) / run_key(run_dir)
        self.rank, self.world = rank, world
        # which run the parts belong to: the run dir's own token (rank 0 reads or makes it), so the
        # parts a deleted and remade run dir of the same path left on the nodes are not this run's
        def token() -> str:
            try:
                return lineage_token(run_dir)
            except OSError as err:  # every rank refuses alike
                raise SaveFailed(f"train.fast_save_dir: cannot keep the fast tier's token in the run dir "
                                 f"({Path(run_dir) / LINEAGE_FILE}: {err.strerror or err}); "
                                 f"fix its permissions") from None
        self.lineage = decided_by_rank_zero(token)
        # a "node" is the ranks that share one node-local directory: its host and the directory
        # (on one host, several such directories act as several nodes, as the tests' do)
        node = (f"{socket.gethostname()}:{Path(root).resolve()}", private_problem(self.dir))
        nodes = [node] if not dist.is_initialized() else [None] * dist.get_world_size()
        if dist.is_initialized():
            dist.all_gather_object(nodes, node)
        # every rank ends with the same line: a refusal on one node must not leave the others waiting
        if problem := next((problem for _, problem in nodes if problem), None):
            raise SaveFailed(problem)
        nodes = [name for name, _ in nodes]
        self.buddy: Optional[int] = buddies(nodes)[rank]
        self.senders = [r for r, b in enumerate(buddies(nodes)) if b == rank]  # ranks whose copy this rank keeps
        # parts travel as host bytes: a gloo group works under NCCL's default group too; its timeout
        # is the job's, so a hung buddy ends the job after train.collective_timeout_s like any peer
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() and world > 1 else None

    # ---- saving ------------------------------------------------------------------------------

    def save(self, step: int, write_part: Callable[[Path], dict]) -> None:
        """Write this rank's part of step `step` (write_part(directory) writes the files and returns
        the rank's record), mark it done, swap parts with the buddies, then drop older parts."""
        if problem := private_problem(self.dir):  # made again after a restore or a clear() removed it
            raise SaveFailed(problem)
        # an abandoned timeline's newer steps (a run that went back to an earlier checkpoint), before
        # this save's folder exists: every node-mate is in this save or ending the one before, which
        # drops older steps only (dropped after the barrier, a newer step could be the next save a
        # node-mate had begun: its folder went under it, seen in CI)
        self._drop_steps(lambda found: found > step)
        step_dir = self.dir / f"global_step{step}"
        part = step_dir / f"rank{self.rank}"
        (step_dir / f"rank{self.rank}.done.json").unlink(missing_ok=True)  # first: then the files are not used
        shutil.rmtree(part, ignore_errors=True)  # debris of a save that crashed at this step
        part.mkdir(parents=True, exist_ok=True)
        record = write_part(part)
        universal.sync_dirs(part, record["files"])  # its files are fsync'd by their writers
        write_record(part, record)
        files = _hash_part(part, record["files"])
        marker = {"step": step, "world": self.world, "rank": self.rank, "lineage": self.lineage, "files": files}
        atomic_write_text(step_dir / f"rank{self.rank}.done.json", json.dumps({**marker, "copy": "own"}) + "\n")
        if self.buddy is not None or self.senders:
            self._swap_with_buddies(step_dir, part, marker)
        if self.group is not None:
            # step `step` is complete only once every rank holds its part and its senders' copies: a
            # rank that dropped its previous part on finishing its own exchange lost the set of the
            # previous step while a peer that died mid-exchange left this one incomplete (seen in CI:
            # neither step could be restored)
            dist.barrier(group=self.group)
        self._drop_steps(lambda found: found < step)

    def _swap_with_buddies(self, step_dir: Path, part: Path, marker: dict) -> None:
        """Send this part to the buddy and receive each sender's, as one uint8 tensor each: a JSON
        header (the marker) and the files' bytes in the header's order. Sends are asynchronous and
        every receive has its send, so any buddy map (uneven nodes too) completes."""
        payload = _pack(part, marker) if self.buddy is not None else None
        sent = []
        if payload is not None:
            sent.append(dist.isend(torch.tensor([payload.numel()], dtype=torch.int64), self.buddy, group=self.group))
            sent.append(dist.isend(payload, self.buddy, group=self.group))
        for sender in self.senders:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, sender, group=self.group)
            incoming = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(incoming, sender, group=self.group)
            received = _unpack(incoming, step_dir, sender)
            atomic_write_text(step_dir / f"rank{received['rank']}.done.json",
                              json.dumps({**received, "copy": "buddy"}) + "\n")
        for work in sent:
            work.wait()

    def _drop_steps(self, which: Callable[[int], bool]) -> None:
        """Delete this rank's and its senders' parts of the steps `which` picks (by step number)."""
        mine = {self.rank, *self.senders}
        for step_dir in _step_dirs(self.dir):
            if not which(int(_STEP_DIR.fullmatch(step_dir.name).group(1))):
                continue
            for rank in mine:
                (step_dir / f"rank{rank}.done.json").unlink(missing_ok=True)  # first: a part without it is not used
                shutil.rmtree(step_dir / f"rank{rank}", ignore_errors=True)
            try:
                step_dir.rmdir()  # the last rank of the node to drop it
            except OSError:
                pass

    def clear(self) -> None:
        """At the end of a finished run, or once a restore is decided: everything of this run on the
        node goes (parts of ranks a resize renumbered too). Every rank of the node clears; the last
        step's collectives ran after any rank's last part was written, so nothing new is lost."""
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- restoring ---------------------------------------------------------------------------

    def inventory(self) -> dict[int, dict[int, dict]]:
        """{step: {rank: marker}} of the complete parts on this node."""
        found: dict[int, dict[int, dict]] = {}
        for step_dir in _step_dirs(self.dir):
            for done in step_dir.glob("rank*.done.json"):
                if not _DONE.fullmatch(done.name):
                    continue
                try:  # node-local memory may be shared: a planted link or a foreign marker is no part of ours
                    marker = json_text.loads(read_capped(done, universal.JSON_CAP))
                    step, rank = int(marker["step"]), int(marker["rank"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if marker.get("lineage") != self.lineage:  # another run's, in a run dir of the same path
                    continue
                found.setdefault(step, {})[rank] = marker
        return found

    def _pooled(self) -> list:
        """Every rank's inventory (collective over the default group)."""
        mine = self.inventory()
        everyone = [mine] if not dist.is_initialized() else [None] * dist.get_world_size()
        if dist.is_initialized():
            dist.all_gather_object(everyone, mine)
        return everyone

    def newest_complete(self) -> int:
        """The newest step whose every rank's part the nodes hold together, 0 for none. Collective."""
        return next((step for step, _, _ in _complete_steps(self._pooled(), 0)), 0)

    def restore(self, save_dir: Path, shared_step: int, publish: Callable[[Path, int, int], None]) -> Optional[str]:
        """Before a resume: publish the newest complete set of parts newer than shared_step into
        save_dir as a normal checkpoint (publish(tmp, step, world) on rank 0). Collective over the
        default group. Returns the line to print (on rank 0), or None when there is nothing newer."""
        for step, holders, world in _complete_steps(self._pooled(), shared_step):
            tmp = Path(save_dir) / f"tmp-global_step{step}"
            problem = None
            if self.rank == 0:
                universal.to_trash(tmp)  # a half-published step: not deleted while every rank waits
                tmp.mkdir(parents=True, exist_ok=True)
            _barrier()
            for old_rank, (holder, marker) in sorted(holders.items()):
                if holder == self.rank:
                    problem = problem or _copy_part(self.dir / f"global_step{step}", old_rank, marker, tmp)
            problems = [problem] if not dist.is_initialized() else [None] * dist.get_world_size()
            if dist.is_initialized():
                dist.all_gather_object(problems, problem)
            if any(problems):  # a part that does not verify: the next older complete step, if any
                if self.rank == 0:
                    universal.to_trash(tmp)
                continue
            if self.rank == 0:
                publish(tmp, step, world)
            _barrier()
            self.clear()  # on shared storage now; what else the node holds is older or from another layout
            own = sorted(r for r, (_, m) in holders.items() if m["copy"] == "own")
            buddy = sorted(r for r, (_, m) in holders.items() if m["copy"] == "buddy")
            return (f"restored global_step{step} from node-local memory (newer than the shared checkpoint of step "
                    f"{shared_step}): the parts of {_ranks(own)} from their own node"
                    + (f", of {_ranks(buddy)} from a buddy's copy" if buddy else ""))
        _barrier()
        self.clear()  # nothing usable: older than the shared checkpoint, incomplete, or not verifying
        return None


LINEAGE_FILE = ".fast_tier_lineage"  # in the run dir: the token the fast tier's parts carry


def lineage_token(run_dir: Path) -> str:
    """The run dir's fast-tier token, made on first use and kept for every later attempt of the run
    (it lives and dies with the run dir). A missing, unreadable or malformed one is made anew: parts
    that no longer match are then not restored, which costs at most the steps since the shared
    checkpoint."""
    path = Path(run_dir) / LINEAGE_FILE
    try:
        token = read_capped(path, 256).decode().strip()
        if re.fullmatch(r"[0-9a-f]{32}", token):
            return token
    except (OSError, UnicodeDecodeError):
        pass
    token = os.urandom(16).hex()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, token + "\n")
    return token


def private_problem(path: Path) -> Optional[str]:
    """Make path this user's own directory (0700), or say why it is not one. Node-local memory
    (/dev/shm) is every user's, and a run's directory name is known to anyone who knows the run dir
    (run_key), so another user could make it first, or a link in its place, and so read the parts (the
    model's weights) or plant a newer step that a restore would publish and resume from; and whoever
    owns the folder it is made in can swap it. So the folder must be this user's or root's, the
    directory this user's and writable by nobody else; one that others may only read (an older
    megaframe's 0755) is made private. Checked when the tier starts and before every save (a restore
    or a finished run removes the directory)."""
    fix = "remove it, or set train.fast_save_dir to a directory of your own (e.g. /dev/shm/megaframe-$USER)"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        holder = os.stat(path.parent)  # train.fast_save_dir itself may be a link (/dev/shm -> /run/shm)
        if holder.st_uid not in (os.getuid(), 0):
            return (f"train.fast_save_dir: {path.parent} is owned by uid {holder.st_uid}, who could swap this run's "
                    f"directory in it; the fast tier neither writes nor restores there: {fix}")
        path.mkdir(mode=0o700, exist_ok=True)
        found = os.lstat(path)
        if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and not found.st_mode & 0o022:
            if found.st_mode & 0o077:
                os.chmod(path, 0o700)
            return None
    except OSError as err:
        return (f"train.fast_save_dir: cannot make {path} ({err.strerror or type(err).__name__}); "
                f"free space or fix permissions, or set train.fast_save_dir elsewhere")
    what = ("a link" if stat.S_ISLNK(found.st_mode) else "not a directory" if not stat.S_ISDIR(found.st_mode)
            else f"owned by uid {found.st_uid}" if found.st_uid != os.getuid()
            else f"writable by others (mode {stat.S_IMODE(found.st_mode):o})")
    return (f"train.fast_save_dir: {path} is {what}, not this user's private directory; the fast tier neither "
            f"writes nor restores there: {fix}")


def buddies(nodes: list[str]) -> list[Optional[int]]:
    """Each rank's buddy: the rank at its position (cyclically) among the next node's ranks, the
    nodes in the order of their first rank; None for every rank when there is one node. Uneven
    nodes (Ray places any number of workers on a node) give some ranks several senders, some none."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    ranks_of = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    result: list[Optional[int]] = []
    for rank, node in enumerate(nodes):
        following = ranks_of[order[(order.index(node) + 1) % len(order)]]
        result.append(following[ranks_of[node].index(rank) % len(following)])
    return result


def _complete_steps(everyone: list[dict[int, dict[int, dict]]], shared_step: int):
    """(step, {old rank: (holder rank, marker)}, world) of every step newer than shared_step whose
    parts, over all nodes, cover every rank of its world, newest first. A node's own copy is
    preferred to a buddy's. Every rank of a node lists the same parts, so among equals the part's
    own rank restores it when it lists it, else the holder with the fewest parts so far (the same
    answer on every rank: `everyone` is one gathered list). The lowest holder used to restore all of
    its node's parts (8 to 16, verified and copied one after another) while the others waited."""
    steps = sorted({step for inventory in everyone for step in inventory if step > shared_step}, reverse=True)
    for step in steps:
        candidates: dict[int, list[tuple[int, dict]]] = {}
        worlds = set()
        for holder, inventory in enumerate(everyone):
            for old_rank, marker in inventory.get(step, {}).items():
                worlds.add(int(marker["world"]))
                candidates.setdefault(old_rank, []).append((holder, marker))
        if len(worlds) != 1 or set(candidates) != set(range(next(iter(worlds)))):
            continue
        holders: dict[int, tuple[int, dict]] = {}
        load: dict[int, int] = {}  # parts given to each holder so far
        for old_rank in sorted(candidates):
            best = [c for c in candidates[old_rank] if c[1]["copy"] == "own"] or candidates[old_rank]
            mine = next((c for c in best if c[0] == old_rank), None)
            holders[old_rank] = mine or min(best, key=lambda c: (load.get(c[0], 0), c[0]))
            load[holders[old_rank][0]] = load.get(holders[old_rank][0], 0) + 1
        yield step, holders, len(holders)


def _copy_part(step_dir: Path, old_rank: int, marker: dict, tmp: Path) -> Optional[str]:
    """Verify rank old_rank's part (every file's size and sha256) and copy it into tmp; why not, or None.
    The copies and their directories are fsync'd: the node's parts are deleted once it is published."""
    part = step_dir / f"rank{old_rank}"
    for rel, entry in marker["files"].items():
        try:  # a marker naming ../x would copy another file of the node into the checkpoint
            source = universal.inside(part, rel, f"rank{old_rank}.done.json")
        except universal.CheckpointError:
            return f"the part of rank {old_rank} names a file outside it ({rel!r})"
        if not source.is_file() or universal.file_entry(source) != entry:
            return f"the part of rank {old_rank} ({source}) does not verify"
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fsync_file(shutil.copyfile(source, target))
    universal.sync_dirs(tmp, marker["files"])
    return None


def _hash_part(part: Path, hashed: dict[str, dict]) -> dict[str, dict]:
    """Every file of the part: its shard and RNG file as the rank hashed them while writing, the
    small rest (its record, rank 0's state.json) hashed here."""
    return {rel: hashed.get(rel) or universal.file_entry(part / rel)
            for rel in (p.relative_to(part).as_posix() for p in sorted(part.rglob("*")) if p.is_file())}


def _pack(part: Path, marker: dict) -> torch.Tensor:
    names = sorted(marker["files"])
    header = json.dumps({**marker, "order": names}).encode()
    blobs = [len(header).to_bytes(8, "little"), header] + [(part / rel).read_bytes() for rel in names]
    return torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)


def _unpack(payload: torch.Tensor, step_dir: Path, sender: int) -> dict:
    """Write sender's part from its payload into step_dir/rank{sender}/; returns its marker. The
    payload is checked before anything is written: it is the sender's part (a mixed-up buddy map
    would otherwise overwrite another rank's copy), its names stay inside the part, and its files
    fill the payload exactly (a torn or mis-sized message is refused rather than half-written)."""
    data = payload.numpy().tobytes()
    size = int.from_bytes(data[:8], "little")
    marker = json_text.loads(data[8:8 + size])
    order = marker.pop("order")
    part = step_dir / f"rank{sender}"
    if marker.get("rank") != sender or sorted(order) != sorted(marker["files"]):
        said = (f"says rank {marker.get('rank')}" if marker.get("rank") != sender
                else "lists other files than it carries")
        raise SaveFailed(f"fast tier: the part received from rank {sender} {said}; "
                         f"the buddies' exchange is mixed up, report this as a megaframe bug")
    try:
        targets = [universal.inside(part, rel, f"rank {sender}'s fast-tier part") for rel in order]
    except universal.CheckpointError as err:
        raise SaveFailed(f"fast tier: {err}") from None
    lengths = [marker["files"][rel]["bytes"] for rel in order]
    if 8 + size + sum(lengths) != len(data):
        raise SaveFailed(f"fast tier: the part received from rank {sender} is {len(data)} bytes where its "
                         f"files say {8 + size + sum(lengths)}; the exchange was torn, report this as a megaframe bug")
    (step_dir / f"rank{sender}.done.json").unlink(missing_ok=True)  # the old copy is not used from here on
    shutil.rmtree(part, ignore_errors=True)
    offset = 8 + size
    for target, length in zip(targets, lengths):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[offset:offset + length])
        fsync_file(target)  # a no-op on /dev/shm; train.fast_save_dir may be a disk
        offset += length
    universal.sync_dirs(part, marker["files"])
    return marker


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)),
                  key=lambda p: int(_STEP_DIR.fullmatch(p.name).group(1)))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + (", ".join(str(r) for r in ranks) or "none")
