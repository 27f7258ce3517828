"""Two runs' checkpoints, each exported to Hugging Face and run by transformers: the same logits."""
from __future__ import annotations

from pathlib import Path


def assert_same_hf_logits(run_dir: Path, reference_dir: Path, tmp_path: Path) -> None:
    """Both checkpoints exported to Hugging Face and run by transformers give the same logits (the
    weights themselves differ by a few fp32 ulps of summation order, which Adam's normalised update
    turns into up to 5e-6 on elements whose gradient is near zero)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megaframe.convert.cli import export_hf

    export_hf(run_dir / "checkpoints", tmp_path / "hf-run")
    export_hf(reference_dir / "checkpoints", tmp_path / "hf-reference")
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    got, want = (AutoModelForCausalLM.from_pretrained(str(tmp_path / d)).eval()(tokens).logits.detach()
                 for d in ("hf-run", "hf-reference"))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
