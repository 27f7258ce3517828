#!/usr/bin/env bash
# The whole GPU tier and the CUDA benchmark, on a lent GPU machine, in one command; one report.
#
#   here (CPU machine, project venv active):  ../shared/gpu/wheels.sh        # fills .whl/
#   there (GPU machine, carrying .whl):        bash tools/gpu_tier.sh [PYTEST ARGS]   # report in $OUT (or ./gpu-report)
#
# Installs what the GPU image lacks from .whl/ into /tmp/site, runs `pytest tests/gpu` (every test:
# one GPU, two where present), then tools/bench.py --device cuda at the tiny shape and at GPT-3 XL,
# and writes REPORT.md with the device, versions, each command, the pass/fail lines and the
# benchmark tables; the full logs sit beside it. Exit status: pytest's (the benchmark's failures
# are in the report). Copy the tables into BENCHMARKS.md with the date.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-report}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ext}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
report="$out/REPORT.md"
{
  echo "# GPU tier report, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "- devices: $(nvidia-smi -L 2>/dev/null | tr '\n' ';' || echo 'nvidia-smi unavailable')"
  echo "- $(python3 -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}")' 2>&1)"
  echo "- $(python3 -c 'import deepspeed; print(f"deepspeed {deepspeed.__version__}")' 2>&1 | tail -1)"
} > "$report"

echo "## tests/gpu" >> "$report"
echo '`python3 -m pytest -q -rA tests/gpu`' >> "$report"
python3 -m pytest -q -rA -p no:cacheprovider tests/gpu "$@" > "$out/gpu-tests.log" 2>&1
tests_rc=$?
{ echo '```'; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" | tail -80; echo '```'; } >> "$report"
# the figures the tests print (loss gaps, syncs per step, planned against measured peaks)
{ echo '```'; grep -E "gap to|syncs per step|planned .* measured" "$out/gpu-tests.log" | head -60; echo '```'; } >> "$report"

for shape in tiny xl; do
  for arch in gpt2 llama; do
    cmd="python3 tools/bench.py --device cuda --shape $shape --arch $arch"
    echo "## $cmd" >> "$report"
    $cmd > "$out/bench-$shape-$arch.log" 2>&1 || echo "(exit $?: see bench-$shape-$arch.log)" >> "$report"
    grep -E "^\||planner|on NVIDIA|^[a-z0-9]+ on " "$out/bench-$shape-$arch.log" >> "$report"
  done
done
# the two engines at ZeRO-3 on every GPU of the machine (dp = their number), bf16, GPT-3 XL's shape
gpus=$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
cmd="torchrun --standalone --nproc_per_node=$gpus tools/bench_engines.py precision=bf16 model.num_layers=24 model.hidden_size=2048 model.num_attention_heads=16 model.ffn_hidden_size=8192 model.seq_length=2048 parallel.micro_batch_size=1"
echo "## $cmd" >> "$report"
DS_ACCELERATOR=cuda $cmd > "$out/bench-engines.log" 2>&1 || echo "(exit $?: see bench-engines.log)" >> "$report"
grep -E "median|ratio|FSDP2|DeepSpeed" "$out/bench-engines.log" | tail -6 >> "$report"
echo "report: $report"
exit $tests_rc
