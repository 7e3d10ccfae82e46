#!/usr/bin/env bash
# One command for a CUDA machine with torch preinstalled, no network and no fastai (from the repository root):
#     bash tools/gpu-check.sh [WHEELS_DIR]        (default .whl, prepared by `bash tools/fetch-wheels.sh`)
# 1. installs from the wheel folder, into $SITE (default /tmp/site; nothing else on the machine changes): fastai's own
#    stack always (fastai, fastcore, fasttransform, fastdownload, fastprogress 1.0.3, plum-dispatch, beartype), any
#    other wheel only when the machine lacks that package (the preinstalled torch, numpy... stay as they are);
# 2. runs `pytest --device cuda -x -q`, the main job `python -m fp16cb --device cuda`, the benchmark's GPU workloads
#    `python -m bench --device cuda --json bench/results_cuda.json`, then on the LM the memory modes (`--modes memory`:
#    half_storage, step_in_backward), the compiled comparison (`--compile`) and the optimizer step with stored state
#    beside torchao's 8-bit AdamW (`python -m bench.state8_quality --parts speed --peers`), each to the end even if one
#    failed.
# Logs and a copy of the results go to $OUT (default ./gpu-check-out); the exit status is 0 only if every step passed.
# GPU_CHECK_DEVICE=cpu runs the same on a CPU (a rehearsal of the script; its benchmark JSON stays in $OUT);
# PYTEST_ARGS, DEMO_ARGS and BENCH_ARGS add arguments (e.g. BENCH_ARGS="--workloads lm --rounds 5"); GPU_CHECK_STEPS
# names the checks to run (default: all, "pytest demo bench bench-memory bench-compile state8"; "profile" on request), to split the check over two
# commands where one command's time is limited. On an H100 (2026-11-25) the steps took: pytest 160-230 s with
# PYTEST_ARGS="-n 10 --maxfail=300" (pytest-xdist), demo 17 s, bench about 450 s, bench-memory 58 s, bench-compile 133 s;
# on an H200 (2026-11-26): pytest 140 s with -n 12, demo 10 s, bench's two ResNet-50 workloads about 60 s each.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-${WHEELS_DIR:-.whl}}"
OUT="${OUT:-$PWD/gpu-check-out}"
SITE="${SITE:-/tmp/site}"
DEV="${GPU_CHECK_DEVICE:-cuda}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
log() { echo "[gpu-check] $*" | tee -a "$OUT/gpu-check.log"; }

if ! "$PY" -c "import torch, sys; sys.exit(0 if '$DEV' == 'cpu' or torch.cuda.is_available() else 1)"; then
  log "torch is missing or sees no CUDA device (GPU_CHECK_DEVICE=cpu rehearses this script on a CPU)"; exit 2
fi
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { log "no wheels in $WHEELS: run 'bash tools/fetch-wheels.sh $WHEELS' first"; exit 2; }

# ---- 1. install: which wheels this machine needs
TO_INSTALL=$("$PY" - "$WHEELS" <<'PY'
import glob, os, sys, importlib.metadata as md
always = {'fastai', 'fastcore', 'fasttransform', 'fastdownload', 'fastprogress', 'plum_dispatch', 'beartype'}
for w in sorted(glob.glob(os.path.join(sys.argv[1], '*.whl'))):
    name = os.path.basename(w).split('-')[0]
    try: md.version(name); present = True
    except md.PackageNotFoundError: present = False
    if name.lower() in always or not present: print(w)
PY
) || { log "could not read $WHEELS"; exit 2; }
log "installing into $SITE: $(echo $TO_INSTALL | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
mkdir -p "$SITE"
if "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" $TO_INSTALL >> "$OUT/gpu-check.log" 2>&1
else  # no pip: a wheel is a zip of its files, laid out as site-packages wants them
  for w in $TO_INSTALL; do "$PY" -m zipfile -e "$w" "$SITE" || false; done >> "$OUT/gpu-check.log" 2>&1
fi || { tail -n 5 "$OUT/gpu-check.log"; log "installing from $WHEELS failed (wheels for another Python? this is $("$PY" -V))"; exit 2; }
export PYTHONPATH="$SITE:$PWD"
export MPLBACKEND=Agg
SITE="$SITE" "$PY" - > "$OUT/env.txt" 2>&1 <<'PY'
import os, sys, platform, torch, fastai, fastcore, fastprogress, fp16cb
print('python', sys.version.split()[0], platform.platform())
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print('fastai', fastai.__version__, 'fastcore', fastcore.__version__, 'fastprogress', fastprogress.__version__, 'from', fastai.__file__)
print('fp16cb from', fp16cb.__file__)
site = os.path.realpath(os.environ['SITE'])
assert all(os.path.realpath(m.__file__).startswith(site) for m in (fastai, fastcore, fastprogress)), "fastai's stack is not the one in $SITE"
PY
status=$?; tee -a "$OUT/gpu-check.log" < "$OUT/env.txt"
[ $status -eq 0 ] || { log "the installed packages do not import as they should (see $OUT/env.txt)"; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

# ---- 2. the checks
case "$DEV" in cuda*) JSON=bench/results_cuda.json ;; *) JSON="$OUT/bench_results_$DEV.json" ;; esac
run() {  # name, command...: its output to $OUT/name.log, its status remembered
  local name=$1; shift
  log "$name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "$name: exit $rc after $((SECONDS - t0)) s; tail of $OUT/$name.log:"; tail -n 15 "$OUT/$name.log" | tee -a "$OUT/gpu-check.log"
  return $rc
}
STEPS=" ${GPU_CHECK_STEPS:-pytest demo bench bench-memory bench-compile state8} "
failed=()
step() { [[ "$STEPS" == *" $1 "* ]] || return 0; run "$@" || failed+=("$1"); }  # name, command...: if asked for
step pytest "$PY" -m pytest --device "$DEV" -x -v -p no:cacheprovider ${PYTEST_ARGS:-}  # -v: each result as it ends
step demo "$PY" -m fp16cb --device "$DEV" ${DEMO_ARGS:-}
step bench "$PY" -m bench --device "$DEV" --json "$JSON" ${BENCH_ARGS:-}
# the modes that trade speed for memory (16-bit storage, the step in the backward) and torch.compile, on the LM
step bench-memory "$PY" -m bench --device "$DEV" --modes memory --opts adam --workloads lm --json "$OUT/bench_memory.json" ${BENCH_ARGS:-}
step bench-compile "$PY" -m bench --device "$DEV" --compile --workloads lm --json "$OUT/bench_compile.json" ${BENCH_ARGS:-}
# the optimizer step with bf16 and 8-bit state and with half_storage, beside torchao's (and bitsandbytes') AdamW8bit
# (the compiled Adam steps are off on a GPU until measured there: the `-compiled` modes measure them)
step state8 "$PY" -m bench.state8_quality --parts speed --peers --device "$DEV" --json "$OUT/state8_speed_$DEV.json" \
  --speed-modes fp32,bf16,bf16-state16,bf16-state16-compiled,bf16-state8,bf16-half,bf16-half-compiled
# opt-in (GPU_CHECK_STEPS=profile): where a step's time goes, mode by mode, at two chunk sizes of the lift (PROFILE_ARGS
# replaces the arguments, e.g. PROFILE_ARGS="--workload lm --modes bf16 --lift-chunks 22,25")
step profile "$PY" -m bench.profile_gpu --device "$DEV" ${PROFILE_ARGS:---workload resnet50 --lift-chunks 22,25 --opts adam,fused}
[ -f "$JSON" ] && cp "$JSON" "$OUT/" 2>/dev/null
if [ ${#failed[@]} -eq 0 ]; then log "all passed; results in $OUT"; exit 0; fi
log "FAILED: ${failed[*]} (logs in $OUT)"; exit 1
