#!/usr/bin/env bash
# Everything distsgd can check only on a GPU, in one command of at most 9.5 minutes on one GPU:
#
#     benchmarks/gpu_check.sh OUT_FOLDER
#
# the GPU tests, the bare-PyTorch probe (TF32, CUDA graphs, Hogwild! threads on streams), the short
# parts of benchmarks/gpu.py (single against bare, the topologies, --cuda-graphs, Hogwild! threads,
# --compile), the examples and the habits check on the GPU. Every step runs
# under `timeout`, so one that hangs costs its own limit and no more; each writes its log under
# OUT_FOLDER, and OUT_FOLDER/summary.txt says how each step ended. Run from the repository root,
# with distsgd importable (PYTHONPATH=src or an editable install).
set -uo pipefail
out="${1:?usage: benchmarks/gpu_check.sh OUT_FOLDER}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)/src"
summary="$out/summary.txt"
: >"$summary"

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local tb
  tb=$(grep -c "^Traceback" "$out/$name.log")
  echo "$name: rc=$rc in $((SECONDS - t0)) s, $tb tracebacks" | tee -a "$summary"
  pack
}

pack() {  # the device tool returns a limited number of files: everything in one archive beside the
  # folder, written again after each step (to a temporary name, then renamed) so a call cut off at
  # its limit still returns every step that finished
  rm -rf "$out/gpu/tf32-model" 2>/dev/null
  tar czf "$out.tgz.part" -C "$(dirname "$out")" "$(basename "$out")" && mv "$out.tgz.part" "$out.tgz"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "mps control: $(command -v nvidia-cuda-mps-control || echo absent); pipe dir: $(ls -d /tmp/nvidia-mps 2>/dev/null || echo absent)"
  nproc
} >"$out/machine.txt" 2>&1

# the limits add up to 570 s, inside one device call of 600 s; the most telling steps first
step tests 170 python -m pytest -v -m gpu -n 4 -p no:cacheprovider  # -v: each result as it lands, if the step is cut
step gpu_py 180 python benchmarks/gpu.py --parts bare,topologies,graphs,compile --repeats 2 --samples 12800 --out "$out/gpu"
step probe 60 python benchmarks/gpu_probe.py --out "$out"
step example_allreduce 40 python examples/plain_loop.py
step example_hogwild 40 python examples/plain_loop.py --algo hogwild
step habits 80 python benchmarks/habits.py --habits bf16,clip --algos allreduce,hogwild,asgd
cat "$summary"
