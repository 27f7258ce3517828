"""The CUDA-shaped device itself (tests/support/fakecuda): it computes what the CPU computes, and it fails
where CUDA or NCCL would. Each seeded mutant is a small piece of code with one device-discipline bug;
the tier must refuse it (or count its host read), and the same code without the bug must pass.

All checks run in two forked ranks that install the device (the pytest process never does: its
patches to torch would reach every other test). One fork serves every check here."""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.slow  # two ranks (about 6 s)


def _outcome(fn) -> str:
    """'ok', or the refusal's first line ('refused: ...'), or another error's type and line."""
    from tests.support.fakecuda.ledger import CudaError

    try:
        fn()
        return "ok"
    except CudaError as err:
        return f"refused: {str(err).splitlines()[0]}"
    except Exception as err:  # noqa: BLE001 - reported to the test, which names what it expected
        return f"error: {type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"


def _syncs_of(fn) -> list[tuple[str, str]]:
    """The (kind, call site) of each host read fn makes, once per read."""
    from tests.support.fakecuda import ledger

    before = dict(ledger.syncs)
    fn()
    return [k for k, n in ledger.syncs.items() for _ in range(n - before.get(k, 0))]


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _adam_state_devices(model) -> set:
    return {str(t.device) for p in model.parameters() for t in getattr(p, "adam_state", {}).values()}


def _train(model: torch.nn.Module, device: str, steps: int = 3) -> list[float]:
    """AdamW (fused) on a fixed batch: the losses, read once at the end."""
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.linspace(-1, 1, 5 * 8).view(5, 8).to(device)
    target = torch.arange(5).remainder(4).to(device)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    for p in model.parameters():  # where fused AdamW keeps its state (the step included)
        p.adam_state = {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}
    return torch.stack(losses).tolist()


def _checks(rank: int, world: int) -> dict:
    from tests.support import fakecuda

    fakecuda.install(deepspeed=True)
    from tests.support.fakecuda import ledger

    out: dict = {}
    # a collective before set_device: every rank would use cuda:0
    out["collective_before_set_device"] = _outcome(lambda: dist.all_reduce(torch.ones(2, device="cuda")))
    torch.cuda.set_device(rank)
    dev = f"cuda:{rank}"
    ledger.reset()

    # ---- positive: the same numbers as the CPU, on a device that says cuda ------------------
    cpu_losses = _train(_tiny_model(), "cpu")
    model = _tiny_model()
    first_weight = model[0].weight
    first_weight.shard_mark = "kept"  # an attribute other code put on the parameter
    cuda_losses = _train(model, dev)
    out["losses"] = (cpu_losses, cuda_losses)
    out["param_kept"] = (model[0].weight is first_weight, getattr(model[0].weight, "shard_mark", None))
    tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(4, 8), "head": torch.nn.Linear(8, 4, bias=False)})
    tied.head.weight = tied.embed.weight
    tied.to(dev).to(torch.float64)  # a move, then a cast: both visit the shared weight twice
    out["tied_kept"] = (tied.head.weight is tied.embed.weight, str(tied.head.weight.device), str(tied.head.weight.dtype))
    out["reports_cuda"] = (first_weight.is_cuda, str(first_weight.device), first_weight.get_device(),
                           str(next(iter(_adam_state_devices(model)))),
                           torch.tensor([1, 2], device="cuda").device.index, torch.ones(2).cuda().is_cuda)
    out["violations_in_positive"] = list(ledger.violations)

    # ---- random draws: the device's own generator -----------------------------------------------
    torch.cuda.manual_seed(7)
    a = torch.randn(4, device="cuda")
    torch.randn(100)  # a CPU draw in between must not move the device's stream
    b = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(7)
    a2, b2 = torch.randn(4, device="cuda"), torch.rand(4, device="cuda")
    state = torch.cuda.get_rng_state()
    c = torch.randn(4, device="cuda")
    torch.cuda.set_rng_state(state)
    c2 = torch.randn(4, device="cuda")
    out["rng"] = (torch.equal(a, a2) and torch.equal(b, b2), torch.equal(c, c2))
    out["device_generator_accepted"] = _outcome(
        lambda: torch.randn(3, device="cuda", generator=torch.cuda.default_generators[rank]))

    # ---- mutants: each must be refused (or counted) -----------------------------------------------
    x = torch.ones(4, 4, device=dev)
    out["mixed_device_op"] = _outcome(lambda: x + torch.ones(4, 4))
    out["host_scalar_ok"] = _outcome(lambda: x * torch.tensor(2.0))
    out["host_scalar_written"] = _outcome(lambda: torch.tensor(0.0).add_(x.sum()))
    out["meta_tensor_op"] = _outcome(lambda: x + torch.ones(4, 4, device="meta"))
    out["host_tensor_in_collective"] = _outcome(lambda: dist.all_reduce(torch.ones(3)))
    out["device_tensor_in_collective"] = _outcome(lambda: dist.all_reduce(torch.ones(3, device=dev)))
    out["object_collective"] = _outcome(lambda: dist.broadcast_object_list([{"run": "dir"}], src=0))
    out["cpu_generator_for_device_tensor"] = _outcome(
        lambda: torch.randn(3, device="cuda", generator=torch.Generator().manual_seed(0)))
    out["cpu_generator_for_device_normal_"] = _outcome(
        lambda: torch.empty(3, device="cuda").normal_(generator=torch.Generator()))

    def fused_adam_with_host_step():
        p = torch.zeros(3, device=dev)
        torch._fused_adamw_([p], [torch.ones(3, device=dev)], [torch.zeros(3, device=dev)],
                            [torch.zeros(3, device=dev)], [], [torch.tensor(1.0)], lr=0.1, beta1=0.9, beta2=0.99,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    out["fused_adam_host_step"] = _outcome(fused_adam_with_host_step)

    # ---- host reads: an .item() per micro-batch is counted per micro-batch --------------------------
    def loop(micro_batches: int, item_per_micro_batch: bool) -> None:
        total = torch.zeros((), device=dev)
        for _ in range(micro_batches):
            loss = (x * 3).mean()
            if item_per_micro_batch:
                float(loss.item())  # the mutant: a read back per micro-batch
            total += loss
        total.item()  # once per step: allowed
    out["syncs_clean"] = (len(_syncs_of(lambda: loop(1, False))), len(_syncs_of(lambda: loop(4, False))))
    out["syncs_mutant"] = (len(_syncs_of(lambda: loop(1, True))), len(_syncs_of(lambda: loop(4, True))))
    out["sync_sites"] = sorted({site for _, site in _syncs_of(lambda: loop(2, True))})
    idx = torch.tensor([0, 1, 1, 3], device=dev)
    out["kernel_syncs"] = {
        "bincount": _syncs_of(lambda: torch.bincount(idx))[0][0],
        "nonzero": _syncs_of(lambda: torch.nonzero(idx))[0][0],
        "masked_select": _syncs_of(lambda: torch.masked_select(idx, idx > 0))[0][0],
        "unique": _syncs_of(lambda: torch.unique(idx))[0][0],
        "repeat_interleave": _syncs_of(lambda: torch.repeat_interleave(idx))[0][0],
        "cpu": _syncs_of(lambda: idx.cpu())[0][0],
        "tolist": _syncs_of(lambda: idx.tolist())[0][0],
        "copy_to_host": _syncs_of(lambda: torch.empty(4, dtype=torch.long).copy_(idx))[0][0],
    }
    out["no_sync"] = _syncs_of(lambda: torch.repeat_interleave(idx, idx, output_size=5) + idx.sum())

    # ---- CUDA-only kernels: contracts -------------------------------------------------------------
    q = torch.randn(1, 2, 16, 8, device=dev, dtype=torch.bfloat16)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    res = flash(q, q, q, 0.0, True)
    out["flash_lse"] = (str(res[1].dtype), tuple(res[1].shape), res[1].is_contiguous())
    out["flash_fp32_refused"] = _outcome(lambda: flash(q.float(), q.float(), q.float(), 0.0, True))
    q12 = torch.randn(1, 2, 16, 12, device=dev, dtype=torch.bfloat16)
    out["flash_head_dim_refused"] = _outcome(lambda: flash(q12, q12, q12, 0.0, True))
    a, b = (torch.randn(16, 32, device=dev).to(torch.float8_e4m3fn) for _ in range(2))
    one, scaled_mm = torch.ones((), device=dev), torch._scaled_mm
    out["scaled_mm_ok"] = _outcome(lambda: scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16))  # b.t(): column-major
    out["scaled_mm_row_major_refused"] = _outcome(
        lambda: scaled_mm(a, b.t().contiguous(), one, one, out_dtype=torch.bfloat16))
    out["scaled_mm_shape_refused"] = _outcome(
        lambda: scaled_mm(a[:, :24], b[:, :24].t(), one, one, out_dtype=torch.bfloat16))
    out["scaled_mm_host_scale_refused"] = _outcome(
        lambda: scaled_mm(a, b.t(), torch.ones(()), one, out_dtype=torch.bfloat16))
    qa = torch.randn(2, 2, 16, 8, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(qa, qa, qa, is_causal=True)
    ref.sum().backward()
    qd = qa.detach().to(dev).requires_grad_()
    got = torch.nn.functional.scaled_dot_product_attention(qd, qd, qd, is_causal=True)
    got.sum().backward()
    out["sdpa_fp32"] = (torch.allclose(got.cpu(), ref.detach(), atol=1e-6), torch.allclose(qd.grad.cpu(), qa.grad, atol=1e-5))
    out["accelerator"] = _accelerator_checks(dev)
    out["violations"] = len(ledger.violations)
    return out


def _accelerator_checks(dev: str) -> dict:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return {"name": acc.device_name(), "current": acc.current_device_name(),
            "byte": str(acc.ByteTensor([1]).device), "float": str(acc.FloatTensor([1.0, 2.0]).device),
            "backend": acc.communication_backend_name(), "synchronized": acc.is_synchronized_device()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_checks, 2, tmp_path_factory.mktemp("fakecuda"))


def test_training_on_the_device_gives_the_cpu_numbers(results):
    for r in results:
        cpu, cuda = r["losses"]
        assert cuda == pytest.approx(cpu, rel=1e-6, abs=0), (cpu, cuda)
        assert r["violations_in_positive"] == []


def test_tensors_say_cuda_and_module_to_keeps_parameters(results):
    for rank, r in enumerate(results):
        assert r["reports_cuda"] == (True, f"cuda:{rank}", rank, f"cuda:{rank}", rank, True)
        assert r["param_kept"] == (True, "kept")
        assert r["tied_kept"] == (True, f"cuda:{rank}", "torch.float64")


def test_device_random_draws_come_from_their_own_generator(results):
    for r in results:
        assert r["rng"] == (True, True)  # a CPU draw between the device's draws does not move the device's stream
        assert r["device_generator_accepted"] == "ok"


@pytest.mark.parametrize("mutant, message", [
    ("collective_before_set_device", "before torch.cuda.set_device"),
    ("mixed_device_op", "Expected all tensors to be on the same device"),
    ("meta_tensor_op", "cuda:0 and meta"),
    ("host_tensor_in_collective", "Tensors must be CUDA and dense"),
    ("cpu_generator_for_device_tensor", "Expected a 'cuda' device type for generator"),
    ("cpu_generator_for_device_normal_", "Expected a 'cuda' device type for generator"),
    ("fused_adam_host_step", "Expected all tensors to be on the same device"),
    ("host_scalar_written", "cpu (written)"),
    ("flash_fp32_refused", "fp16 and bf16"),
    ("flash_head_dim_refused", "multiple of 8"),
    ("scaled_mm_row_major_refused", "column-major"),
    ("scaled_mm_shape_refused", "divisible by 16"),
    ("scaled_mm_host_scale_refused", "Expected all tensors to be on the same device"),
])
def test_seeded_mutants_are_refused(results, mutant, message):
    got = results[0][mutant]
    assert got.startswith("refused:") and message in got, got


def test_what_cuda_allows_passes(results):
    for r in results:
        for check in ("host_scalar_ok", "device_tensor_in_collective", "object_collective", "scaled_mm_ok"):
            assert r[check] == "ok", (check, r[check])


def test_a_host_read_per_micro_batch_is_counted(results):
    r = results[0]
    assert r["syncs_clean"] == (1, 1)  # once per step, whatever the number of micro-batches
    assert r["syncs_mutant"] == (2, 5)  # the mutant reads once more per micro-batch
    assert any("test_device.py" in site and "loop" in site for site in r["sync_sites"]), r["sync_sites"]


def test_kernels_that_synchronise_inside_are_counted(results):
    kinds = results[0]["kernel_syncs"]
    assert kinds == {"bincount": "bincount", "nonzero": "nonzero", "masked_select": "masked_select", "unique": "unique",
                     "repeat_interleave": "repeat_interleave without output_size", "cpu": "to host",
                     "tolist": "tolist", "copy_to_host": "copy_ to host"}
    assert results[0]["no_sync"] == []


def test_flash_attention_contract_and_sdpa_numbers(results):
    r = results[0]
    assert r["flash_lse"] == ("torch.float32", (1, 2, 16), True)
    assert r["sdpa_fp32"] == (True, True)


def test_deepspeed_sees_a_cuda_accelerator(results):
    for rank, r in enumerate(results):
        assert r["accelerator"] == {"name": "cuda", "current": f"cuda:{rank}", "byte": f"cuda:{rank}",
                                    "float": f"cuda:{rank}", "backend": "gloo", "synchronized": False}
