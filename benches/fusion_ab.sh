#!/usr/bin/env bash
# Side by side on two cores: rlx with fusion (the default), rlx with RLX_FUSION=0, and PyTorch
# eager (when installed), each workload of bench_cpu.py in its own process, alternating, for
# ROUNDS rounds. Usage: bash benches/fusion_ab.sh [ROUNDS] [CORES]   (e.g. 2 0,1)
# WORKLOADS="gpt gpt_large" picks workloads (default: mlp64 mlp512 gpt gpt_large).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
cores=${2:-0,1}
have_torch=$(python -c "import torch" 2>/dev/null && echo 1 || echo 0)
for r in $(seq "$rounds"); do
  for w in ${WORKLOADS:-mlp64 mlp512 gpt gpt_large}; do
    steps=200; [ "$w" = gpt ] && steps=120; [ "$w" = gpt_large ] && steps=60
    for v in fused unfused torch; do
      fw=rlx; env_set="RLX_FUSION=1"
      case $v in unfused) env_set="RLX_FUSION=0" ;; torch) fw=torch; [ "$have_torch" = 1 ] || continue ;; esac
      line=$(env "$env_set" taskset -c "$cores" python benches/bench_cpu.py --child "$fw" "$w" --steps "$steps" 2>&1 | grep '^RESULT ' || true)
      echo "round $r $w $v: $(python -c 'import json,sys; d=json.loads(sys.argv[1][7:]); print("step %.3f ms (p10 %.3f), loss %.4f" % (d["step_ms"], d["step_ms_p10"], d["loss_last"]))' "$line")"
    done
  done
done
