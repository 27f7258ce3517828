"""Every validation rule and every missing system piece, as a user meets them: one line on stderr
naming the key, exit code 2, no traceback, and nothing started (no DeepSpeed engine, no process
group, no run dir)."""
from __future__ import annotations

import pytest

from tests.support.helpers import REPO, cli_env, run_cli
from megaframe.backends.deepspeed.accelerator import device_supports_fp16

# what torchrun and srun set beside RANK and WORLD_SIZE (a world without a rendezvous address is refused
# before the config is read: launch_env.py)
_LAUNCHER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}

# (overrides, environment, fragments the one-line message must contain)
CASES = {
    "unknown key": (["model.hidden_sise=64"], {}, ["unknown key 'model.hidden_sise'", "hidden_size"]),
    "unknown key added with +": (["+optim.momentum=0.9"], {}, ["unknown key 'optim.momentum'", "betas"]),
    "unknown group option": (["model=gpt_huge"], {}, ["model=gpt_huge", "gpt_tiny", "llama_tiny"]),
    "wrong type": (["model.num_layers=four"], {}, ["model.num_layers", "four"]),
    "hidden not divisible by heads": (["model.hidden_size=130"], {}, ["model.hidden_size=130", "model.num_attention_heads=4"]),
    "kv heads do not divide heads": (["model.num_kv_heads=3"], {}, ["model.num_kv_heads=3", "[1, 2, 4]"]),
    "global batch not divisible": (["parallel.global_batch_size=20", "parallel.micro_batch_size=8"], {},
                                   ["parallel.global_batch_size=20", "micro_batch_size*dp=8*1=8"]),
    "global batch not divisible by dp": (["parallel.dp=2", "parallel.global_batch_size=24", "parallel.micro_batch_size=8"], {},
                                         ["parallel.global_batch_size=24", "8*2=16"]),
    "tp*pp*dp != world (launcher)": (["parallel.dp=4"], {"WORLD_SIZE": "2", "RANK": "0", **_LAUNCHER},
                                     ["parallel.tp*parallel.pp*parallel.dp=1*1*4=4", "world size is 2"]),
    "world not divisible by tp*pp": (["parallel.pp=2", "model.num_layers=4", "zero=stage1"], {"WORLD_SIZE": "3", "RANK": "0", **_LAUNCHER},
                                     ["world size 3", "parallel.tp*parallel.pp=2"]),
    "seq_length < 1": (["model.seq_length=0"], {}, ["model.seq_length=0", ">= 1"]),
    # the group is optional, and Hydra skipped the missing option in silence: the default model trained
    "unknown recipe": (["recipe=llama2_7x"], {}, ["recipe=llama2_7x: no such recipe; available: gpt3_175b,", "llama2_7b"]),
    "renamed key": (["launcher.gpus_per_node=8"], {}, ["launcher.gpus_per_node is now cluster.gpus_per_node",
                                                       "use cluster.gpus_per_node=8"]),
    "missing data path": (["data.path=/nonexistent/corpus"], {}, ["data.path=/nonexistent/corpus", ".bin not found", "megaframe-preprocess"]),
    "nvme without path": (["zero=stage3", "offload=nvme"], {}, ["offload.nvme_path"]),
    "nvme with zero < 3": (["zero=stage2", "offload.optimizer=nvme", "offload.nvme_path=/tmp/x"], {},
                           ["NVMe offload needs zero=stage3", "zero.stage=2"]),
    "param offload without zero 3": (["zero=stage2", "offload.param=cpu"], {}, ["offload.param=cpu", "zero=stage3"]),
    "optimizer offload without zero": (["offload=cpu"], {}, ["offload.optimizer=cpu", "zero=stage1"]),
    "pipeline with zero >= 2": (["parallel.pp=2", "zero=stage2"], {}, ["parallel.pp=2", "zero.stage=2", "zero=stage1"]),
    "tp does not divide heads": (["parallel.tp=3"], {}, ["parallel.tp=3 does not divide model.num_attention_heads=4", "[1, 2, 4]"]),
    "tp does not divide ffn": (["parallel.tp=4", "model.ffn_hidden_size=510"], {}, ["parallel.tp=4 does not divide model.ffn_hidden_size=510"]),
    "sequence parallel without tp": (["parallel.sequence_parallel=true"], {}, ["parallel.sequence_parallel=true needs parallel.tp > 1"]),
    "sequence parallel, seq not divisible": (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=127"], {},
                                             ["model.seq_length=127 divisible by parallel.tp=2"]),
    "pp exceeds layers": (["parallel.pp=8", "zero=stage1"], {}, ["parallel.pp=8 exceeds model.num_layers=4"]),
    "bad pipeline partition": (["parallel.pipeline_partition=random"], {}, ["parallel.pipeline_partition='random'", "uniform"]),
    "bad choice": (["model.norm=batchnorm"], {}, ["model.norm='batchnorm'", "layernorm", "rmsnorm"]),
    "resume path missing": (["train.resume=/nonexistent/ckpt"], {}, ["train.resume", "/nonexistent/ckpt"]),
    "no skips allowed": (["train.max_consecutive_skips=0"], {}, ["train.max_consecutive_skips=0", ">= 1"]),
    "spike action unknown": (["train.spike.action=ignore"], {}, ["train.spike.action='ignore'", "skip", "warn"]),
    "spike metric unknown": (["train.spike.metric=mad"], {}, ["train.spike.metric='mad'", "zscore", "ratio"]),
    "spike window too short": (["train.spike.window=1"], {}, ["train.spike.window=1", ">= 2"]),
    "spike ratio that cannot trigger": (["train.spike.metric=ratio", "train.spike.threshold=0.5"], {},
                                        ["train.spike.threshold=0.5", "> 1", "train.spike.metric=ratio"]),
    "collective timeout not positive": (["train.collective_timeout_s=0"], {}, ["train.collective_timeout_s=0", "> 0"]),
    # the machine, checked before any rank starts (backends/deepspeed/system.py)
    "nvme offload without libaio": (["zero=stage3", "offload=nvme", "offload.nvme_path=/tmp/megaframe-nvme"],
                                    {"PYTHONPATH": str(REPO / "tests" / "support" / "simulate" / "no_libaio")},
                                    ["offload=nvme", "async-IO op cannot load", "libaio-dev", "offload=cpu"]),
    "nvme path not writable": (["zero=stage3", "offload=nvme", "offload.nvme_path=/etc/hostname/swap"], {},
                               ["offload.nvme_path=/etc/hostname/swap is not writable"]),
    "cpu adam without a compiler": (["zero=stage2", "offload=cpu"],
                                    {"CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": "/nonexistent/megaframe-ext"},
                                    ["offload.optimizer=cpu", "no C++ compiler", "/nonexistent/c++"]),
    # each of these used to pass validation and fail after launch (or blame another key)
    "optimizer eps zero": (["optim.eps=0"], {}, ["optim.eps=0.0 must be a finite number > 0"]),
    "learning rate nan": (["optim.lr=nan"], {}, ["optim.lr=nan must be a finite number > 0"]),
    "weight decay nan": (["optim.weight_decay=nan"], {}, ["optim.weight_decay=nan must be a finite number >= 0"]),
    "negative seed": (["train.seed=-1"], {}, ["train.seed=-1 must be in [0, 2**32)"]),
    "collective timeout infinite": (["train.collective_timeout_s=inf"], {}, ["train.collective_timeout_s=inf", "finite"]),
    "evaluation of no batches": (["train.eval_steps=0", "train.eval_interval=5"], {},
                                 ["train.eval_steps=0 with train.eval_interval=5", "train.eval_interval=0"]),
    "batch size change policy": (["train.on_batch_size_change=ignore"], {}, ["train.on_batch_size_change='ignore'", "move_position"]),
    "init std nan": (["model.init_std=nan"], {}, ["model.init_std=nan must be a finite number > 0"]),
    "norm eps zero": (["model.norm_eps=0"], {}, ["model.norm_eps=0.0 must be a finite number > 0"]),
    "rope theta zero": (["model.rope_theta=0"], {}, ["model.rope_theta=0.0 must be a finite number > 0"]),
    "negative peak": (["cluster.peak_tflops=-5"], {}, ["cluster.peak_tflops=-5.0 must be a finite number > 0, or null"]),
    "negative reservation": (["cluster.reserved_gb=-1"], {}, ["cluster.reserved_gb=-1.0 must be a finite number >= 0"]),
    "online W&B without a key": (["logging.wandb.mode=online"], {"WANDB_API_KEY": "", "NETRC": "/nonexistent/netrc"},
                                 ["logging.wandb.mode=online but no W&B key", "WANDB_API_KEY", "wandb sync"]),
}


def _assert_refused(result, fragments: list[str]) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert lines[0].startswith("megaframe-train: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert "Traceback" not in result.stdout + result.stderr
    assert "DeepSpeed info" not in result.stdout and "deepspeed.initialize" not in result.stdout


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_is_refused_with_one_line(case, tmp_path):
    overrides, env, fragments = CASES[case]
    # max_steps=1: a case that is accidentally valid fails fast on the exit code, not on a timeout
    result = run_cli([*overrides, "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], env=cli_env(**env), timeout=120)
    _assert_refused(result, fragments)
    assert not (tmp_path / "run").exists(), "a refused config must not create a run dir"


def test_a_mistyped_key_is_refused_at_once_by_a_fresh_interpreter(tmp_path):
    """What a user's terminal shows, from a new interpreter (not the tests' warm one): one line and exit
    2, without importing torch, DeepSpeed or the trainer first (a refusal costs about 0.3 CPU-s, not
    the 6 of a run's imports)."""
    import subprocess
    import sys

    # megaframe-train's entry point as `python -m megaframe.train` runs it; then what it had imported
    probe = ("import runpy, sys\ntry:\n    runpy.run_module('megaframe.train', run_name='__main__', alter_sys=True)\n"
             "finally:\n    print(sorted(m for m in ('torch', 'deepspeed', 'megaframe.training.trainer') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe, "model.hidden_sise=64", f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    _assert_refused(result, CASES["unknown key"][2])
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
    assert not (tmp_path / "run").exists()


def test_fp16_refused_where_the_device_lacks_it(tmp_path):
    result = run_cli(["precision=fp16", f"hydra.run.dir={tmp_path / 'run'}", "train.max_steps=1"], timeout=300)
    if device_supports_fp16():  # a GPU or an AVX512-FP16 CPU: the run must go through
        assert result.returncode == 0, result.stderr
    else:
        _assert_refused(result, ["precision=fp16", "precision=bf16"])


def test_too_few_micro_batches_for_the_pipeline_warns(tmp_path):
    """Legal but wasteful: fewer micro-batches than stages. The config composes (--cfg job prints it);
    a real launch prints the warning first. Checked here without launching: validation's warnings()."""
    from megaframe.config.compose import compose
    from megaframe.config.validate import validate, warnings

    cfg, _ = compose(["parallel.pp=4", "zero=stage1", "parallel.micro_batch_size=8", "parallel.global_batch_size=16"])
    layout = validate(cfg, 4, lambda: False)
    (message,) = warnings(cfg, layout)
    assert "parallel.pp=4 with 2 micro-batches" in message and "global_batch_size to >= 32" in message
    assert "60%" in message  # (4-1)/(2+4-1)


def _byte_dataset(prefix, layout: str) -> None:
    import numpy as np

    from megaframe.data import IndexedDatasetWriter

    with IndexedDatasetWriter(prefix, dtype=np.uint16, layout=layout) as writer:
        for doc in range(50):
            writer.add_document(np.arange(doc, doc + 200) % 256)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})


def _truncate_bin(prefix) -> None:
    data = open(f"{prefix}.bin", "rb").read()
    open(f"{prefix}.bin", "wb").write(data[: len(data) // 2])


def _bad_magic(prefix) -> None:
    data = bytearray(open(f"{prefix}.idx", "rb").read())
    data[:8] = b"MMIDIDX\x00" if data.startswith(b"MFTOKIDX") else b"MFTOKIDY"
    open(f"{prefix}.idx", "wb").write(bytes(data))


def _json_of_another_build(prefix) -> None:
    import json

    meta = json.loads(open(f"{prefix}.json").read())
    meta["checksum"] = "0" * 32  # MFTOKIDX keeps the checksum in the .idx header too
    meta["num_documents"] += 1  # the Megatron layout's sidecar is matched by its counts at open
    open(f"{prefix}.json", "w").write(json.dumps(meta))


DATA_CASES = {  # damage done to a valid dataset -> fragments of the one-line refusal, per layout
    "truncated .bin": (_truncate_bin, {"megaframe": ["corpus.bin holds", "truncated or from another build"],
                                       "megatron": ["points past the end of", "truncated"]}),
    "bad magic": (_bad_magic, ["neither a megaframe (MFTOKIDX) nor a Megatron (MMIDIDX) index (bad magic bytes)"]),
    ".json of another build": (_json_of_another_build, ["belongs to a different build", "megaframe-preprocess"]),
}


@pytest.mark.parametrize("layout", ["megatron", "megaframe"])
@pytest.mark.parametrize("case", list(DATA_CASES))
def test_broken_dataset_files_are_refused_before_launch(case, layout, tmp_path):
    damage, fragments = DATA_CASES[case]
    fragments = fragments[layout] if isinstance(fragments, dict) else fragments
    prefix = tmp_path / "corpus"
    _byte_dataset(prefix, layout)
    damage(prefix)
    result = run_cli([f"data.path={prefix}", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    _assert_refused(result, [f"data.path={prefix}", *fragments])
    assert not (tmp_path / "run").exists()


def test_too_few_tokens_for_one_sample_is_refused_before_launch(tmp_path):
    """Found by splitting the data as the ranks will, before any starts (was exit 4 after launch)."""
    import numpy as np

    from megaframe.data import IndexedDatasetWriter

    prefix = tmp_path / "tiny"
    with IndexedDatasetWriter(prefix, dtype=np.uint16, layout="megaframe") as writer:
        for doc in range(5):  # 50 tokens: 40 in the training split (documents [0, 4)); seq_length is 128
            writer.add_document(np.arange(doc, doc + 10) % 256)
        writer.finalize({"tokenizer": "byte", "vocab_size": 257, "eod_id": 256})
    result = run_cli([f"data.path={prefix}", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    _assert_refused(result, [f"data.path={prefix}", "only 40 tokens in documents [0, 4)",
                             "fewer than model.seq_length+1=129", "use more text or a shorter seq_length"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["the run dir is a file", "its parent is a file"])
def test_an_unusable_run_dir_is_one_line_with_exit_2(where, tmp_path):
    """Used to end in a traceback from Hydra's mkdir. (A read-only parent would be the same error,
    but CI runs as root, whom permissions do not stop.)"""
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a directory\n")
    run_dir = blocker if where == "the run dir is a file" else blocker / "run"
    result = run_cli(["train.max_steps=1", f"hydra.run.dir={run_dir}"], timeout=120)
    _assert_refused(result, [f"hydra.run.dir={run_dir}", "cannot create the run directory", "choose another"])
    assert blocker.read_text() == "a file, not a directory\n"
