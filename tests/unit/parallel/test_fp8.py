"""fp8 at the matmul seam (parallel/fp8/): each recipe's linear against the bf16 one (torchao's own
acceptance is output SQNR >= 18 dB and weight-gradient SQNR >= 17 dB; the issue asks 20 / 17), the
experts' grouped GEMM in MXFP8, and which matmuls a recipe takes: not the router, the LM head only
when asked, not the first and last precision.fp8.bf16_layers blocks. One process, emulated as the
CPU runs it (and tensorwise on torch._scaled_mm's CPU kernel, emulate=false)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megaframe.config.compose import compose
from megaframe.model.dims import resolve_dims
from megaframe.model.factory import build_model
from megaframe.parallel.dims import ParallelDims
from megaframe.parallel.fp8 import describe, recipe_for
from megaframe.parallel.layers import TPGroup
from megaframe.parallel.matmul import DEFAULT, MatmulSite
from megaframe.parallel.state import ParallelState

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
M, K, N = 256, 128, 96  # multiples of MXFP8's 32-element blocks


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB (torchao's compute_error, written out here)."""
    ref, got = ref.double(), got.double()
    return (20 * torch.log10(ref.norm() / (ref - got).norm())).item()


def _fp8(recipe: str, emulate="auto", **keys):
    cfg = compose(["precision=fp8", f"precision.fp8.recipe={recipe}", f"precision.fp8.emulate={emulate}",
                   *[f"precision.fp8.{k}={v}" for k, v in keys.items()]])[0]
    return cfg, recipe_for(cfg.precision, cfg.model.num_layers, "cpu")


def _linear(matmul, kind: str = "column"):
    """(output, input grad, weight grad) of x Wᵀ at a tp=1 site of `kind`, in bf16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16().requires_grad_(True)
    grad = torch.randn(M, N, generator=g).bfloat16()
    y = MatmulSite(kind, TPGroup(matmul=matmul)).linear(x, w)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe,emulate", [*[(r, "auto") for r in RECIPES], ("tensorwise", "false")])
def test_each_recipe_tracks_the_bf16_linear(recipe, emulate):
    cfg, matmul = _fp8(recipe, emulate)
    assert matmul.name == recipe and matmul.emulate == (emulate == "auto")
    y_ref, gx_ref, gw_ref = _linear(DEFAULT)
    y, gx, gw = _linear(matmul)
    assert y.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert _sqnr(y_ref, y) >= 20, recipe
    assert _sqnr(gw_ref, gw) >= 17, recipe
    assert _sqnr(gx_ref, gx) >= 17, recipe
    # and it is not the bf16 arithmetic under another name: fp8 moves the output
    assert _sqnr(y_ref, y) < 60
    # the router stays in the default arithmetic, bitwise
    assert all(torch.equal(a, b) for a, b in zip(_linear(DEFAULT, "router"), _linear(matmul, "router")))


class _OneDnnAtScaledMm(torch.utils._python_dispatch.TorchDispatchMode):
    """Whether oneDNN was switched on at each GEMM of torchao's float8 tensors (their dispatch turns it
    into torch._scaled_mm, below this mode)."""

    def __init__(self):
        super().__init__()
        self.seen: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default and any(type(a).__name__ == "Float8TrainingTensor" for a in args):
            self.seen.append(torch.backends.mkldnn.enabled)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_kernels_on_the_cpu_run_torchs_kernel_and_give_onednns_bits(recipe, monkeypatch):
    """fp8 kernels on the CPU (emulate=false): each of the three GEMMs runs torch._scaled_mm with oneDNN
    off (on an AMX host its fp8 path is a reference loop: parallel/matmul.py gemm), and oneDNN is back
    on after; the output and gradients are torch._scaled_mm's, left to pick its own path, to bf16's
    rounding (the same fp8 products, summed in another order)."""
    import megaframe.parallel.fp8.scaled as scaled

    _, matmul = _fp8(recipe, "false")
    assert torch.backends.mkldnn.enabled
    with _OneDnnAtScaledMm() as calls:
        ours = _linear(matmul)
    assert calls.seen == [False, False, False] and torch.backends.mkldnn.enabled
    monkeypatch.setattr(scaled, "gemm", lambda a, b, fp8_kernel=False: torch.mm(a, b))
    with _OneDnnAtScaledMm() as calls:
        theirs = _linear(matmul)
    assert calls.seen == [True, True, True]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)  # bf16: rtol 1.6e-2, atol 1e-5


def test_mxfp8_computes_the_experts_grouped_gemm():
    _, matmul = _fp8("mxfp8")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(4, N, K, generator=g) / K ** 0.5).bfloat16()
    offsets = torch.tensor([64, 96, 192, 256], dtype=torch.int32)  # uneven groups of tokens
    outs = {}
    for name, recipe in (("bf16", DEFAULT), ("mxfp8", matmul)):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = MatmulSite("experts", TPGroup(matmul=recipe)).grouped_mm(xi, wi, offsets)
        y.float().square().sum().backward()
        outs[name] = (y.detach(), xi.grad, wi.grad)
    (y_ref, gx_ref, gw_ref), (y, gx, gw) = outs["bf16"], outs["mxfp8"]
    assert 20 <= _sqnr(y_ref, y) < 60
    assert _sqnr(gw_ref, gw) >= 17 and _sqnr(gx_ref, gx) >= 17


def _recipe_of_each_site(model) -> dict[str, str]:
    """The recipe name each weight matmul of the model computes with, by the module's name."""
    sites = {}
    for name, module in model.named_modules():
        for attr in ("matmul", "head_matmul"):
            site = getattr(module, attr, None)
            if isinstance(site, MatmulSite):
                sites[f"{name}.{attr}"] = site.tp.matmul.name
    return sites


def test_bf16_layers_and_the_head_stay_in_the_default_arithmetic():
    cfg = compose(["precision=fp8", "precision.fp8.bf16_layers=1", "model=llama_tiny", "model.num_layers=4",
                   "model.tie_embeddings=false"])[0]
    dims = resolve_dims(cfg.model, 96)
    model = build_model(dims, ParallelState(ParallelDims(), rank=0), seed=1,
                        matmul=recipe_for(cfg.precision, dims.num_layers, "cpu"))
    sites = _recipe_of_each_site(model)
    block = lambda i: {v for k, v in sites.items() if k.startswith(f"blocks.{i}.")}
    assert block(0) == block(3) == {"default"} and block(1) == block(2) == {"tensorwise"}
    assert sites["head.matmul"] == "tensorwise"  # the site carries the recipe; the recipe leaves the head alone
    assert not model.head.matmul.tp.matmul.takes(model.head.matmul)
    head_asked = recipe_for(compose(["precision=fp8", "precision.fp8.head=true"])[0].precision, 4, "cpu")
    assert head_asked.takes(model.head.matmul)
    # no fp8: the default recipe on every site, the model as it always was
    plain = recipe_for(compose(["precision=bf16"])[0].precision, 4, "cpu")
    assert plain is DEFAULT


def test_the_startup_line_says_the_recipe_and_emulation():
    cfg = compose(["precision=fp8", "precision.fp8.recipe=mxfp8", "precision.fp8.bf16_layers=1"])[0]
    assert describe(cfg.precision.fp8, "cpu") == " fp8=mxfp8 (emulated, bf16_layers=1)"
    assert describe(cfg.precision.fp8, "cuda") == " fp8=mxfp8 (fp8 kernels, bf16_layers=1)"
    assert describe(compose(["precision=bf16"])[0].precision.fp8, "cpu") == ""


def test_only_the_recipes_import_torchao():
    """torchao is an optional extra: megaframe imports and runs without it. Only the two recipe
    modules import it, and nothing imports them by name (recipe_for does, when fp8 is asked)."""
    package = Path(__file__).resolve().parents[3] / "megaframe"
    importers, recipe_importers = set(), set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "torchao" for name in names):
                importers.add(path.relative_to(package).as_posix())
            if any(name in ("megaframe.parallel.fp8.scaled", "megaframe.parallel.fp8.mx") for name in names) or (
                    isinstance(node, ast.ImportFrom) and node.module == "megaframe.parallel.fp8"
                    and {a.name for a in node.names} & {"scaled", "mx"}):
                recipe_importers.add(path.relative_to(package).as_posix())
    assert importers == {"parallel/fp8/scaled.py", "parallel/fp8/mx.py"}
    assert recipe_importers == set()
