#!/usr/bin/env bash
# The whole GPU tier and the CUDA benchmark, on a lent GPU machine, in one command; one report.
#
#   here (CPU machine, project venv active):  ../shared/gpu/wheels.sh        # fills .whl/
#   there (GPU machine, carrying .whl):        bash tools/gpu_tier.sh [PYTEST ARGS]   # report in $OUT (or ./gpu-report)
#
# Installs what the GPU image lacks from .whl/ into /tmp/site, then runs its parts most valuable
# first, appending each part's lines to REPORT.md as soon as it ends (a call cut short keeps what ran):
#   1. tools/bench.py --precision fp8 at GPT-3 XL (1.3B): fp8 and bf16 tokens/s, MFU, peak memory
#      against the planner's, compiled blocks (torchao's fp8 is fast compiled only)
#   2. pytest tests/gpu (every test: one GPU, two where present)
#   3. tools/bench.py at the tiny shape and at GPT-3 XL (gpt2, llama): megaframe against the plain
#      loop and transformers
#   4. fp8 against bf16 at four of Llama-3-8B's layers (seq 8192), then data.document_mask at GPT-3 XL
#   5. the two engines at ZeRO-3 (tools/bench_engines.py)
#   6. how long a save stalls the step loop, sync against async (tools/bench_save.py, one GPU, bf16 ZeRO-1)
# Every part runs under `timeout` within GPU_TIER_BUDGET_S (default 420 s after the install, so the
# whole call stays under 8 minutes); a part with under 20 s left is skipped and the report says so.
# The full logs sit beside the report. Exit status: pytest's (the benchmarks' failures are in the
# report). Copy the tables into BENCHMARKS.md with the date.
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

budget=${GPU_TIER_BUDGET_S:-420}
started=$SECONDS
# part CAP LOG CMD...: CMD under timeout for CAP seconds or what is left of the budget, its output in
# $out/LOG; a skip, a timeout or a failure is one line in the report. Returns CMD's status.
part() {
  local cap=$1 log=$2 left rc
  shift 2
  left=$(( budget - (SECONDS - started) ))
  (( left < cap )) && cap=$left
  if (( cap < 20 )); then
    echo "(skipped: ${left}s of the ${budget}s budget left)" >> "$report"
    return 125
  fi
  timeout -k 10 "$cap" "$@" > "$out/$log" 2>&1
  rc=$?
  if (( rc == 124 || rc == 137 )); then
    echo "(stopped at its ${cap}s limit: see $log)" >> "$report"
  elif (( rc != 0 )); then
    echo "(exit $rc: see $log)" >> "$report"
  fi
  return $rc
}
# bench CAP LOG ARGS...: one tools/bench.py run on CUDA as a part, its tables into the report
bench() {
  local cap=$1 log=$2
  shift 2
  echo "## python3 tools/bench.py --device cuda $*" >> "$report"
  part "$cap" "$log" python3 tools/bench.py --device cuda "$@"
  grep -E "^\||planner|on NVIDIA|^[a-z0-9]+ on |^step time|^megaframe with" "$out/$log" >> "$report" 2>/dev/null
}

# 1. the measurement the fp8 work is for: fp8 (tensorwise) and bf16 at 1.3B, compiled blocks
bench 150 bench-xl-fp8.log --shape xl --precision fp8 --fp8-recipe tensorwise --compile-only --compile-scope blocks \
  --steps 5 --repeats 3 --warmup 3

echo "## tests/gpu" >> "$report"
echo '`python3 -m pytest -q -rA tests/gpu`' >> "$report"
part 180 gpu-tests.log python3 -m pytest -q -rA -p no:cacheprovider tests/gpu "$@"
tests_rc=$?
{ echo '```'; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/gpu-tests.log" 2>/dev/null | tail -80; echo '```'; } >> "$report"
# the figures the tests print (loss gaps, syncs per step, planned against measured peaks)
{ echo '```'; grep -E "gap to|syncs per step|planned .* measured" "$out/gpu-tests.log" 2>/dev/null | head -60; echo '```'; } >> "$report"

for shape in tiny xl; do
  for arch in gpt2 llama; do
    bench 90 "bench-$shape-$arch.log" --shape $shape --arch $arch
  done
done
bench 120 bench-llama8b-fp8.log --shape llama8b --arch llama --precision fp8 --fp8-recipe tensorwise --compile-only \
  --compile-scope blocks --steps 3 --repeats 3 --warmup 3
bench 90 bench-xl-document-mask.log --shape xl --document-mask --no-compile --steps 5 --repeats 3 --warmup 2

# the two engines at ZeRO-3 on every GPU of the machine (dp = their number), bf16, GPT-3 XL's shape
gpus=$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
cmd="torchrun --standalone --nproc_per_node=$gpus tools/bench_engines.py precision=bf16 model.num_layers=24 model.hidden_size=2048 model.num_attention_heads=16 model.ffn_hidden_size=8192 model.seq_length=2048 parallel.micro_batch_size=1"
echo "## $cmd" >> "$report"
DS_ACCELERATOR=cuda part 120 bench-engines.log $cmd
grep -E "median|ratio|FSDP2|DeepSpeed" "$out/bench-engines.log" 2>/dev/null | tail -6 >> "$report"

# an async save's copies go to page-locked buffers without a wait (checkpoint/staging.py): its stall on a GPU
echo "## python3 tools/bench_save.py --saves 3 precision=bf16 zero=stage1" >> "$report"
DS_ACCELERATOR=cuda part 60 bench-save.log python3 tools/bench_save.py --saves 3 precision=bf16 zero=stage1
grep -E "^\||^(sync|async)" "$out/bench-save.log" 2>/dev/null >> "$report"
echo "report: $report ($(( SECONDS - started ))s of the ${budget}s budget used)"
exit $tests_rc
