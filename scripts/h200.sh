#!/usr/bin/env bash
# The GPU runs of issue 7 on the lent H200 machine, one per device call (each fits its 10-minute
# limit). Run from the repository root there, with .whl (and, for DeepSpeed, .dswhl and .deb)
# carried along as DEVELOPERS.md and ../shared/gpu/DEEPSPEED.md say. Results go to $OUT.
#
#   scripts/h200.sh tests      # tests/test_gpu.py + tests/test_fp16.py, log in $OUT/gpu_tests.log
#   scripts/h200.sh dram       # zinf:1 beside DeepSpeed with everything in DRAM
#   scripts/h200.sh nvme       # zinf:0.11/0.5/0 beside DeepSpeed max_in_cpu and all-NVMe
#   scripts/h200.sh transfer   # benchmark (a): zinf's transfers ÷ raw pinned copies
#   scripts/h200.sh heavy      # benchmark (c): batch 32, zinf:1 against everything on the GPU
#   scripts/h200.sh big        # the 554 M GPT (d=1280): zinf:0/0.11/0.5 beside DeepSpeed all-NVMe and max_in_cpu
#   scripts/h200.sh demo       # the main job (zinf demo: profiled, re-planned, migrated) on CUDA
#   scripts/h200.sh planner gpt|moe [ROUNDS] [SECONDS]      # issue 5's placement policies on the CPU (16 cores, a quiet machine)
#   scripts/h200.sh planner-gpu gpt|moe [ROUNDS] [SECONDS]  # the same with the H200 computing (zinf.device cuda)
#   scripts/h200.sh moe-gap    # the skewed MoE at 30% on the GPU: step_phases (both clocks) beside the side-by-side
#                              # benchmark, one engine at a time and in blocks (the 0.146 vs 0.178 s question), 3 rounds
#   scripts/h200.sh issue5     # one call: the MoE at 30% side by side (3 rounds), its step_phases, the GPT at 30% (1 round)
#   scripts/h200.sh moe30      # the MoE at 30% side by side (3 rounds) alone, with its planner log
#   scripts/h200.sh solver     # the planner's solve time at 10^3-10^5 shards on this host's CPU (benchmarks/solver_scale.py)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
install() {  # wheels into /tmp/site once per machine; DeepSpeed's only when asked
  python3 -c "import sqlalchemy, pydantic" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  if [ "${1:-}" = ds ] && ! python3 -c "import deepspeed" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dswhl/*.whl || exit 1
    for f in .deb/*.deb; do dpkg -x "$f" /; done
    ldconfig
  fi
}
moe_side_by_side() {  # SECONDS FILE: the skewed MoE at 30% on the GPU, the three policies side by side, 3 rounds
  timeout "$1" python3 benchmarks/planner_policies.py --path /tmp/pp --device cuda --workload moe --budgets 0.3 \
    --rounds 3 --warmup 40 --steps 32 --replan-every 8 --log-plans > "$2" 2>&1
  rm -rf /tmp/pp
}
moe_step_phases() {  # SECONDS FILE: the same MoE's phases, all-NVMe and adaptive one at a time (both clocks)
  timeout "$1" python3 benchmarks/step_phases.py --path /tmp/sp --device cuda --workload moe --budget 0.3 \
    --policies nvme,adaptive --warmup 40 --steps 32 > "$2" 2>&1
  rm -rf /tmp/sp
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
case "${1:-}" in
  tests)
    install
    timeout 540 python3 -m pytest -q -rs tests/test_gpu.py tests/test_fp16.py -s -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
    tail -n 3 "$OUT/gpu_tests.log" ;;
  dram)
    install ds
    OMP_NUM_THREADS=12 timeout 150 python3 benchmarks/gpu_gpt.py --path /tmp/zb --configs compute,zinf:1 --steps 6 --json "$OUT/zinf_dram.json" > "$OUT/zinf_dram.txt" 2>&1
    timeout 300 python3 benchmarks/gpu_deepspeed.py --offload cpu --steps 6 --json "$OUT/ds_cpu.json" > "$OUT/ds_cpu.txt" 2>&1
    OMP_NUM_THREADS=12 timeout 100 python3 benchmarks/gpu_gpt.py --path /tmp/zb --configs zinf:1 --steps 6 --json "$OUT/zinf_dram2.json" > "$OUT/zinf_dram2.txt" 2>&1
    tail -n 4 "$OUT/zinf_dram.txt" "$OUT/ds_cpu.txt" "$OUT/zinf_dram2.txt" ;;
  nvme)
    install ds
    OMP_NUM_THREADS=12 timeout 150 python3 benchmarks/gpu_gpt.py --path /tmp/zb --configs compute,zinf:0,zinf:0.11,zinf:0.5 --steps 4 --json "$OUT/zinf_nvme.json" > "$OUT/zinf_nvme.txt" 2>&1
    timeout 200 python3 benchmarks/gpu_deepspeed.py --offload nvme --path /tmp/dsw --max-in-cpu 4e8 --steps 4 --json "$OUT/ds_maxincpu.json" > "$OUT/ds_maxincpu.txt" 2>&1
    timeout 200 python3 benchmarks/gpu_deepspeed.py --offload nvme --path /tmp/dsw --steps 4 --json "$OUT/ds_nvme.json" > "$OUT/ds_nvme.txt" 2>&1
    tail -n 6 "$OUT/zinf_nvme.txt"; tail -n 1 "$OUT/ds_maxincpu.txt" "$OUT/ds_nvme.txt" ;;
  transfer)
    install
    timeout 200 python3 benchmarks/gpu_transfer.py --repeats 5 > "$OUT/gpu_transfer.txt" 2>&1
    tail -n 5 "$OUT/gpu_transfer.txt" ;;
  heavy)
    install
    OMP_NUM_THREADS=12 timeout 230 python3 benchmarks/gpu_gpt.py --path /tmp/zb --batch 32 --configs plain,compute,zinf:1 --steps 5 --json "$OUT/heavy.json" > "$OUT/heavy.txt" 2>&1
    tail -n 6 "$OUT/heavy.txt" ;;
  big)
    install ds
    OMP_NUM_THREADS=12 timeout 230 python3 benchmarks/gpu_gpt.py --path /tmp/zb --d 1280 --configs compute,zinf:0,zinf:0.11,zinf:0.5 --steps 4 --json "$OUT/zinf_554m.json" > "$OUT/zinf_554m.txt" 2>&1
    rm -rf /tmp/zb
    timeout 170 python3 benchmarks/gpu_deepspeed.py --d 1280 --offload nvme --path /tmp/dsw --steps 4 --json "$OUT/ds_554m_nvme.json" > "$OUT/ds_554m_nvme.txt" 2>&1
    rm -rf /tmp/dsw
    timeout 170 python3 benchmarks/gpu_deepspeed.py --d 1280 --offload nvme --path /tmp/dsw --max-in-cpu 6e8 --steps 4 --json "$OUT/ds_554m_maxincpu.json" > "$OUT/ds_554m_maxincpu.txt" 2>&1
    tail -n 6 "$OUT/zinf_554m.txt"; tail -n 2 "$OUT/ds_554m_nvme.txt" "$OUT/ds_554m_maxincpu.txt" ;;
  demo)
    install
    mkdir -p /tmp/demo && (cd /tmp/demo && timeout 300 python3 -c "from zinf.cli import main; main()" demo --workdir /tmp/demo) > "$OUT/demo_cuda.txt" 2>&1
    tail -n 20 "$OUT/demo_cuda.txt" ;;
  planner|planner-gpu)  # the CPU computes (16 cores, a quiet machine), or the H200 (8 OpenMP threads leave cores to zinf's)
    install
    wl=${2:-gpt}; extra=""; [ "$wl" = moe ] && extra="--drift-at 40"
    device=cpu; threads=""; [ "$1" = planner-gpu ] && device=cuda && threads="OMP_NUM_THREADS=8"
    log="$OUT/planner_${device}_$wl.txt"
    env $threads timeout "${4:-560}" python3 benchmarks/planner_policies.py --path /tmp/pp --device "$device" --workload "$wl" \
      --budgets 0.2,0.3,0.5 --rounds "${3:-2}" --warmup 40 --steps 32 --replan-every 8 --log-plans $extra > "$log" 2>&1
    grep -A14 "results (state" "$log" | grep "%" | cut -c1-110; tail -n 4 "$log" ;;
  moe-gap)  # (the steady state starts at step 40: trials and their confirmation end by step 32)
    install
    export OMP_NUM_THREADS=8
    moe_step_phases 120 "$OUT/moe_gap_step_phases.txt"
    timeout 150 python3 benchmarks/planner_policies.py --path /tmp/pp --device cuda --workload moe --budgets 0.3 \
      --policies nvme,adaptive --rounds 1 --block 0 --warmup 40 --steps 32 --replan-every 8 > "$OUT/moe_gap_block0.txt" 2>&1
    rm -rf /tmp/pp
    moe_side_by_side 300 "$OUT/moe_gap_side_by_side.txt"
    grep -A3 "loop_s" "$OUT/moe_gap_step_phases.txt"; tail -n 3 "$OUT/moe_gap_block0.txt" "$OUT/moe_gap_side_by_side.txt" ;;
  issue5)  # what moe-gap measures less the one-at-a-time run, and the dense GPT at 30%, in one 10-minute call
    install
    export OMP_NUM_THREADS=8
    moe_side_by_side 290 "$OUT/moe_30_side_by_side.txt"
    moe_step_phases 110 "$OUT/moe_30_step_phases.txt"
    timeout 170 python3 benchmarks/planner_policies.py --path /tmp/pp --device cuda --workload gpt --budgets 0.3 \
      --rounds 1 --warmup 40 --steps 32 --replan-every 8 --log-plans > "$OUT/gpt_30_side_by_side.txt" 2>&1
    grep -h "at 30%" "$OUT/moe_30_side_by_side.txt" "$OUT/gpt_30_side_by_side.txt"; grep -A3 "loop_s" "$OUT/moe_30_step_phases.txt" ;;
  moe30)
    install
    export OMP_NUM_THREADS=8
    moe_side_by_side 290 "$OUT/moe_30_side_by_side.txt"
    grep "zinf planner\|round " "$OUT/moe_30_side_by_side.txt" | cut -c1-160; grep -A5 "moe results" "$OUT/moe_30_side_by_side.txt" | cut -c1-330
    grep -h "at 30%" "$OUT/moe_30_side_by_side.txt" ;;
  solver)
    install
    timeout 200 python3 benchmarks/solver_scale.py --shards 1000,10000,100000 --repeats 5 > "$OUT/solver_scale.txt" 2>&1
    cat "$OUT/solver_scale.txt" ;;
  *)
    sed -n 2,18p "$0"; exit 2 ;;
esac
