#!/usr/bin/env bash
# Everything that needs a GPU, as one short run on a machine with one (see benchmarks/README.md):
#   1. the numerics monitor under CUDA (benchmarks/gpu_check.py: host waits, statistic costs, overhead);
#   2. torchdoctor comm under NCCL on the one GPU: a single rank (checks + bandwidth sweep), two ranks
#      forced onto one GPU (NCCL refuses: the verdict must name the shared GPU, not hang), gloo beside it.
# Writes into $OUT (default /tmp/torchdoctor-device): log.txt, numerics.json, comm.jsonl.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/torchdoctor-device}
mkdir -p "$OUT"
log="$OUT/log.txt"
{
  date -u; nvidia-smi -L
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} >>"$log" 2>&1
step() {  # step NAME TIMEOUT ARGS...: one torchdoctor comm run, its JSON line into comm.jsonl
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s.%N)
  timeout "$limit" "$PY" -m torchdoctor comm "$@" --json >"$OUT/$name.out" 2>>"$log"
  local rc=$? t1=$(date +%s.%N)
  echo "== $name: rc=$rc in $(python3 -c "print(round($t1-$t0,1))") s: torchdoctor comm $*" >>"$log"
  python3 -c "import json,sys; [print(json.dumps({'name': '$name', 'rc': $rc, **json.loads(l)})) for l in open(sys.argv[1]) if l.startswith('{')]" "$OUT/$name.out" >>"$OUT/comm.jsonl"
  rm -f "$OUT/$name.out"
}
step nccl1 90 --local 1
step nccl1_bench 150 --local 1 --bench --sizes 1M:1G:8 --iters 20
step nccl2_shared_gpu 90 --local 2 --backend nccl --timeout 20
step gloo2_gpu 90 --local 2 --backend gloo --bench --sizes 1M,64M --iters 10
echo "== numerics" >>"$log"
timeout 300 "$PY" benchmarks/gpu_check.py --steps 20 --json "$OUT/numerics.json" >>"$log" 2>&1
echo "numerics rc=$?" >>"$log"
