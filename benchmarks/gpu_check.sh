#!/usr/bin/env bash
# Everything distsgd can check only on a GPU, in one command of at most 9.5 minutes on one GPU:
#
#     benchmarks/gpu_check.sh OUT_FOLDER
#
# the GPU tests, where Hogwild! threads' GPU memory peaks (gpu_memory.py), the bare-PyTorch probe
# (TF32, CUDA graphs, Hogwild! threads on streams), the short parts of benchmarks/gpu.py (single
# against bare, --cuda-graphs, Hogwild! threads, --compile) and the examples on the GPU (benchmarks/habits.py and gpu.py's other parts run apart). Every step runs
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

# the limits add up to 570 s, inside one device call of 600 s (run under `timeout -k 5 580`); the
# most telling steps first. The H100 run of 2026-11-28 took 151 s for the tests, 18 and 23 s for
# the examples, and cut bare,topologies,graphs,compile at 180 s in its compile part: --compile has
# its own step now, the topologies (one run each) none. memory: where the GPU memory of Hogwild!
# threads is at its peak with 1 evaluation point and with about 29 (the strict xfail's question)
step tests 170 python -m pytest -v -m gpu -n 4 -p no:cacheprovider  # -v: each result as it lands, if the step is cut
step memory 40 python benchmarks/gpu_memory.py --out "$out/memory"
step gpu_py 135 python benchmarks/gpu.py --parts bare,graphs --repeats 2 --samples 12800 --out "$out/gpu"
step gpu_compile 95 python benchmarks/gpu.py --parts compile --samples 12800 --out "$out/gpu_compile"
step probe 70 python benchmarks/gpu_probe.py --out "$out"
step example_allreduce 30 python examples/plain_loop.py
step example_hogwild 30 python examples/plain_loop.py --algo hogwild
cat "$summary"
