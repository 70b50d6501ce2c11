#!/usr/bin/env bash
# Every GPU measurement of this project in one call (issue 25), for the device tool's one H200 run:
#
#   bash scripts/gpu_suite.sh            # on the device machine: writes tables and logs under $OUT
#   bash scripts/gpu_suite.sh --dry-run  # anywhere: prints the steps and their time limits
#
# Each step has its own time limit so that one slow step cannot eat the others' time; the whole
# suite is sized to finish inside 8 minutes including compiles (steps ordered by value: parity
# first). Every step writes its docs section into the working tree's docs/ (copied to $OUT/docs) and
# its log to $OUT/<step>.log; a failing step is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_suite}"
mkdir -p "$OUT"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1

steps=(
  # name            seconds  command
  "parity           90  python scripts/gpu_parity.py"
  "int4_kernel      90  python scripts/gpu_check.py --write"
  "paged_kernel     90  python scripts/gpu_paged.py --write"
  "ouro_decode     150  python scripts/bench_ouro_shape.py --dtype bfloat16 --modes fp16,int4 --section bench_ouro_shape_gpu"
  "serve           120  python scripts/bench_serve.py --models bundled --arms engine,batch1 --requests 48 --no-write"
)

if [[ $DRY == 0 ]]; then
  python -m pip install --quiet -e ".[test,cuda12]" > "$OUT/install.log" 2>&1 || { echo "install failed"; tail "$OUT/install.log"; exit 1; }
  python -c "import jax; print(jax.devices())" | tee "$OUT/devices.txt"
fi

status=0
for s in "${steps[@]}"; do
  read -r name limit cmd <<< "$s"
  if [[ $DRY == 1 ]]; then
    printf '%-12s %4ss  %s\n' "$name" "$limit" "$cmd"
    continue
  fi
  t0=$(date +%s)
  timeout "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-12s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
  [[ $rc != 0 ]] && status=1 && tail -5 "$OUT/$name.log"
done
[[ $DRY == 0 ]] && cp -r docs "$OUT/docs"
exit $status
