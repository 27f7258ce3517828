"""launch/elastic.py (and its modes in local.py, slurm.py): the world sizes a range allows, the one-line refusals before launch, and the
lines that start the job (torchrun per node, SLURM's script)."""
from __future__ import annotations

import shlex

import pytest

from megaframe.backends.registry import validate_for_engine
from megaframe.config.compose import compose
from megaframe.config.schema import LauncherConfig, TrainConfig
from megaframe.config.launcher_rules import check_elastic, timeout_warning
from megaframe.config.validate import ConfigError
from megaframe.launch.elastic import STORE_ENV, range_problem, stop_file, world_sizes
from megaframe.launch.local import node_command
from megaframe.launch.slurm import elastic_sbatch_script
from megaframe.plan.cli import fit_problem


def _at_world(cfg: TrainConfig, world: int):
    return validate_for_engine(cfg, world, ask_bf16=False)


def _elastic(gpus_per_node: int = 1, **launcher) -> TrainConfig:
    cfg = TrainConfig()
    cfg.cluster.gpus_per_node = gpus_per_node
    for key, value in {"min_nodes": 1, "nodes": 3, **launcher}.items():
        setattr(cfg.launcher, key, value)
    return cfg


def test_torchrun_adds_whole_nodes_and_ray_single_workers():
    assert world_sizes(LauncherConfig(min_nodes=2, nodes=4), 8) == [16, 24, 32]
    assert world_sizes(LauncherConfig(name="ray", min_nodes=1, nodes=2), 2) == [2, 3, 4]


@pytest.mark.parametrize("launcher, train, said", [
    ({"min_nodes": 3, "nodes": 2}, {}, "launcher.min_nodes=3 needs launcher.nodes"),
    ({"nodes": None}, {}, "launcher.min_nodes=1 needs launcher.nodes"),
    ({"min_nodes": 0}, {}, "launcher.min_nodes=0 needs"),
    ({}, {"resume": "none"}, "set train.resume=auto"),
    ({}, {"universal_checkpoint": False}, "set train.universal_checkpoint=true"),
    ({"name": "ray"}, {}, "set launcher.max_failures >= 1"),
    ({"max_restarts": -1}, {}, "launcher.max_restarts=-1 must be >= 0"),
    ({"rdzv_endpoint": "head node:29400"}, {}, "must be HOST or HOST:PORT"),
    ({"rdzv_keep_alive_s": 0}, {}, "launcher.rdzv_keep_alive_s=0 >= 1"),
    ({"rdzv_last_call_s": -1}, {}, "launcher.rdzv_last_call_s=-1 must be >= 0"),
])
def test_elastic_keys_are_refused_in_one_line(launcher, train, said):
    cfg = _elastic(**launcher)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    problem = check_elastic(cfg)
    assert problem is not None and said in problem and "\n" not in problem


def test_a_range_with_a_world_the_batch_does_not_divide_names_it_and_two_fixes():
    cfg, _ = compose(["launcher.min_nodes=1", "launcher.nodes=3", "cluster.gpus_per_node=1",
                      "parallel.micro_batch_size=8", "parallel.global_batch_size=16"])
    problem = range_problem(cfg, _at_world,
                            fit_problem)
    # dp 1 and 2 divide 16/8 micro-batches, dp 3 does not; 48 = lcm(8, 16, 24) divides at every size
    assert problem.startswith("launcher.min_nodes=1 launcher.nodes=3: the job cannot train at world size 3 of [1, 2, 3]")
    assert "narrow the range to launcher.min_nodes=1 launcher.nodes=2" in problem
    assert "parallel.global_batch_size=48" in problem
    cfg.parallel.global_batch_size = 48
    assert range_problem(cfg, _at_world,
                         fit_problem) is None


def test_the_smallest_worlds_that_do_not_fit_are_refused_with_the_planners_verdict():
    cfg, _ = compose(["recipe=llama2_70b", "cluster=h100_80g", "parallel.dp=null", "parallel.pp=1",
                      "launcher.min_nodes=1", "launcher.nodes=4"])
    problem = range_problem(cfg, _at_world,
                            fit_problem)
    # 70B at tp=8, ZeRO-1: the optimizer states of 8 or 16 GPUs exceed 80 GB per device (the planner),
    # and dp=3 does not divide the global batch of 1024. 1020 would divide at every size, but 8 and 16
    # GPUs still would not hold the model: that batch is not offered
    assert "cannot train at world size 8, 16, 24 of [8, 16, 24, 32]; at 8: the planner says it will not fit" in problem
    assert "does NOT fit on h100_80g" in problem
    assert problem.endswith("narrow the range to launcher.min_nodes=4 launcher.nodes=4")


def test_a_layout_error_outside_the_planner_is_reported_for_its_world():
    cfg = _elastic(min_nodes=1, nodes=2)

    def layout_at(_, world: int):
        if world == 1:
            raise ConfigError("parallel.tp=2 needs 2 ranks")
        return world
    assert "at 1: parallel.tp=2 needs 2 ranks" in range_problem(cfg, layout_at, lambda _, layout: None)


def test_each_node_runs_torchrun_with_the_range_c10d_and_its_own_rendezvous_store(tmp_path):
    launcher = LauncherConfig(min_nodes=2, nodes=4, rdzv_endpoint="head01", max_restarts=5)
    line = node_command(launcher, 8, ["launcher.min_nodes=2", "model.num_layers=2"], tmp_path / "run", "megaframe-abc")
    words = shlex.split(line)
    assert words[0] == f"{STORE_ENV}=1"
    # torchrun's agent and flags, run by megaframe's node agent, which reads the job's stop record in the run dir
    assert words[2:6] == ["-m", "megaframe.launch.node_agent", f"--run-dir={tmp_path / 'run'}", "--nnodes=2:4"]
    for flag in ("--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=head01:29400",
                 "--rdzv-id=megaframe-abc", "--max-restarts=5"):
        assert flag in words
    assert words[-3:] == ["megaframe.train", "model.num_layers=2", f"hydra.run.dir={tmp_path / 'run'}"]


def test_the_rendezvous_waits_are_keys_with_torchruns_defaults_in_every_nodes_line(tmp_path):
    """How long a lost node costs (heartbeats until it is dropped, then the last call) is the user's
    to set, and shown in the line at torchrun's own defaults (30 s, 5 s)."""
    def conf(line: str) -> list[str]:
        return [word for word in shlex.split(line) if word.startswith("--rdzv-conf=")]

    assert conf(node_command(LauncherConfig(min_nodes=1, nodes=2), 1, [], tmp_path, "megaframe-a")) == \
        ["--rdzv-conf=last_call_timeout=30,keep_alive_interval=5"]
    quick = LauncherConfig(min_nodes=1, nodes=2, rdzv_last_call_s=15, rdzv_keep_alive_s=2)
    assert conf(node_command(quick, 1, [], tmp_path, "megaframe-a")) == ["--rdzv-conf=last_call_timeout=15,keep_alive_interval=2"]
    srun = elastic_sbatch_script(LauncherConfig(name="slurm", min_nodes=1, nodes=2, rdzv_keep_alive_s=2), 8, [], tmp_path)
    assert "--rdzv-conf=last_call_timeout=30,keep_alive_interval=2" in srun
    cfg, _ = compose(["launcher.min_nodes=1", "launcher.nodes=2", "launcher.rdzv_last_call_s=15"])
    assert (cfg.launcher.rdzv_last_call_s, cfg.launcher.rdzv_keep_alive_s) == (15, 5)


def test_the_elastic_slurm_job_is_one_agent_per_node_over_a_node_range(tmp_path):
    launcher = LauncherConfig(name="slurm", min_nodes=2, nodes=4, cpus_per_task=6)
    script = elastic_sbatch_script(launcher, 8, ["model.num_layers=2"], tmp_path)
    for line in ("#SBATCH --nodes=2-4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --no-kill", "#SBATCH --cpus-per-task=48", f"export {STORE_ENV}=1"):
        assert line in script.splitlines() or any(l.startswith(line) for l in script.splitlines()), line
    srun = next(l for l in script.splitlines() if l.startswith("srun"))
    assert "--kill-on-bad-exit=0 --no-kill --cpus-per-task=${SLURM_CPUS_PER_TASK}" in srun and "--nnodes=2:4" in srun
    assert '"--rdzv-endpoint=${RDZV_HOST}:29400"' in srun and '"--rdzv-id=megaframe-${SLURM_JOB_ID}"' in srun
    # a user's value that holds torchrun's placeholder text is left as typed (a replace over the line rewrote
    # it, and the ${SLURM_JOB_ID} it gained would read as an OmegaConf reference) (hostile review)
    named = "logging.wandb.name='a --rdzv-id=RUN_ID'"
    srun = next(l for l in elastic_sbatch_script(launcher, 8, [named], tmp_path).splitlines() if l.startswith("srun"))
    assert shlex.quote(named) in srun and srun.count("SLURM_JOB_ID") == 1


def test_the_stop_record_is_per_job_in_the_run_dir(tmp_path):
    assert stop_file(tmp_path, "megaframe-1") == tmp_path / ".job_stop" / "megaframe-1.json"
    assert stop_file(tmp_path, "../x y").parent == tmp_path / ".job_stop"


def test_an_elastic_job_with_the_half_hour_timeout_is_warned():
    cfg = _elastic()
    assert "set train.collective_timeout_s=300" in timeout_warning(cfg)
    cfg.train.collective_timeout_s = 120
    assert timeout_warning(cfg) is None
    assert timeout_warning(TrainConfig()) is None


def test_parallel_auto_is_checked_for_a_fitting_layout_at_every_size_of_the_range():
    """parallel=auto re-plans each attempt for its own world: before launch, every world of the
    range must have a layout that fits (the planner's search at that world)."""
    fits, _ = compose(["parallel=auto", "launcher.min_nodes=1", "launcher.nodes=3", "cluster.gpus_per_node=1",
                       "parallel.global_batch_size=48"])
    assert range_problem(fits, _at_world,
                         fit_problem) is None
    # a 1T model on one or two nodes: no layout the search tries fits at either size
    too_big, _ = compose(["parallel=auto", "recipe=gpt_1t", "cluster=h100_80g", "parallel.dp=null", "parallel.tp=8",
                          "parallel.pp=1", "launcher.min_nodes=1", "launcher.nodes=2"])
    problem = range_problem(too_big, _at_world,
                            fit_problem)
    assert "cannot train at world size 8, 16 of [8, 16]; at 8: parallel=auto: no layout of 8 ranks fits" in problem
    assert problem.endswith("no change of the range or the batch alone trains at every size: change the layout or "
                            "the model")


def test_a_range_ray_cannot_narrow_in_whole_nodes_is_not_offered():
    """Ray counts workers: sizes 5 to 7 of 4-GPU nodes are no whole node count; the offered fix
    must be one the range check itself accepts."""
    cfg = _elastic(name="ray", min_nodes=1, nodes=2, gpus_per_node=4, max_failures=3)
    failing = {1, 2, 3, 4, 8}
    problem = range_problem(cfg, lambda _, world: world,
                            lambda _, world: "no" if world in failing else None)
    assert "narrow the range" not in problem
