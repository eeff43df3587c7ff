#!/usr/bin/env bash
# The GPU check (issue 8): run once on a machine with an NVIDIA GPU, a CUDA build of torch and this
# repository copied; no network needed. Ends within GPU_CHECK_BUDGET_S seconds (default 470, under
# 8 minutes): every stage has its own `timeout`, cut to the time left, and the whole script runs
# under an outer `timeout` as a last guard.
#
#   bash bench/gpu_check.sh [OUT_DIR]        (default OUT_DIR: $OUT if set, else ./gpu_check_out)
#
# Stages, in order; a failed stage is reported and the next one still runs:
#   env        GPU, driver, torch and CUDA versions; `zeroinf report`
#   build      pip install -e . (no deps, nothing compiled), then JIT-build the cuda, adam and aio
#              ops in parallel (TORCH_CUDA_ARCH_LIST is honoured; unset = the visible GPU's arch)
#   tests      python -m pytest tests/test_cuda.py tests/test_stage3_cuda.py tests/test_flat_cuda.py (fused kernel vs
#              the torch reference; stages 3 and 2 side-stream copies, sync debug mode, steps vs AdamW)
#   transfers  H2D / D2H GB/s from pinned and pageable memory, both directions at once on two side
#              streams, and the fused gradient kernel vs the three torch ops it replaces
#   nvme       zeroinf.io.AsyncIOHandle: write then read 2 GiB under NVME_DIR, bytes compared
#   compare    3 steps of a tiny model, params + optimizer on NVMe, bf16, `zeroinf train --compare`
#              (the same steps all on the GPU with torch.optim.AdamW; exit 3 when they differ)
#   syncs      steps 2-3 of a tiny engine run under torch.cuda.set_sync_debug_mode("warn"): the
#              number of synchronising calls
#   train1b    `zeroinf train --model llama --size 1b --offload infinity` for STEPS_1B steps (3):
#              step time, share of the step spent waiting on I/O, NVMe GB/s from the engine's counters
#
# Environment: GPU_CHECK_BUDGET_S (470), NVME_DIR (./gpu_check_nvme, removed at the end),
# STEPS_1B (3), SEQ_1B (512), MICRO_BATCH_1B (4), PYTHON (python).
set -uo pipefail

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
if [ -z "${_GPU_CHECK_INNER:-}" ]; then
  _GPU_CHECK_T0=$(date +%s)
  export _GPU_CHECK_INNER=1 _GPU_CHECK_T0
  exec timeout --kill-after=5 "$((BUDGET_S + 5))" bash "$0" "$@"
fi

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUT_DIR=${1:-${OUT:-$REPO/gpu_check_out}}
NVME_DIR=${NVME_DIR:-$REPO/gpu_check_nvme}
PY=${PYTHON:-python}
mkdir -p "$OUT_DIR" "$NVME_DIR"
export ZEROINF_CACHE=${ZEROINF_CACHE:-$REPO/build/zeroinf-cache}   # build/ is git-ignored
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TQDM_DISABLE=1   # no progress bars in the log
export REPO OUT_DIR NVME_DIR PY
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1

DEADLINE=$((_GPU_CHECK_T0 + BUDGET_S - 5))
SUMMARY=()

# run_stage NAME LIMIT_S CMD...: run CMD under `timeout`, cut to the time left; record the outcome.
run_stage() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - $(date +%s)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    SUMMARY+=("$(printf '%-10s SKIPPED (no time left)' "$name")"); return
  fi
  echo; echo "=== $name (limit ${limit}s) ==="
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" bash -o pipefail -c "$*"; rc=$?
  local dt=$(($(date +%s) - t0)) state=ok
  [ $rc -ne 0 ] && state="FAILED rc=$rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && state="TIMEOUT after ${limit}s"
  SUMMARY+=("$(printf '%-10s %-22s %4ss' "$name" "$state" "$dt")")
}

stage_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader || true
  "$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}, "
      f"devices {torch.cuda.device_count()}")
assert torch.version.cuda is not None and torch.cuda.is_available(), "no CUDA build of torch or no GPU"
p = torch.cuda.get_device_properties(0)
print(f"cuda:0 {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
EOF
  local rc=$?
  "$PY" -m zeroinf report || echo "(zeroinf report unavailable)"
  return $rc
}

stage_build() {
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "pip install -e . failed; continuing with PYTHONPATH=$REPO"
  local pids=() op rc=0 jobs=$(( ($(nproc) + 2) / 3 ))
  for op in cuda adam aio; do
    MAX_JOBS=$jobs "$PY" -c "import zeroinf.ops as o; m = o.load_op('$op'); print('$op ->', m.__file__)" \
      > "$OUT_DIR/build_$op.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2; do
    wait "${pids[$i]}" || rc=1
  done
  for op in cuda adam aio; do tail -n 3 "$OUT_DIR/build_$op.log"; done
  return $rc
}

stage_tests() {
  "$PY" -m pytest -q -rs tests/test_cuda.py tests/test_stage3_cuda.py tests/test_flat_cuda.py -p no:cacheprovider 2>&1 | tail -n 25
}

stage_transfers() {
  "$PY" - <<'EOF'
import time
import torch
from zeroinf.ops.cuda_grad import grad_bucket_pass, grad_bucket_pass_reference

def median_s(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]

nbytes = 1 << 30
dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
pinned2 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
pageable = torch.empty(nbytes, dtype=torch.uint8)
h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()  # the runtime's side streams

def on(stream, fn):
    def run():
        with torch.cuda.stream(stream):
            fn()
    return run

gbs = lambda b, s: b / s / 1e9
res = {
    "H2D pinned": gbs(nbytes, median_s(on(h2d_stream, lambda: dev.copy_(pinned, non_blocking=True)))),
    "D2H pinned": gbs(nbytes, median_s(on(d2h_stream, lambda: pinned.copy_(dev, non_blocking=True)))),
    "H2D pageable": gbs(nbytes, median_s(lambda: dev.copy_(pageable))),
    "D2H pageable": gbs(nbytes, median_s(lambda: pageable.copy_(dev))),
}
def both():
    with torch.cuda.stream(h2d_stream):
        dev.copy_(pinned, non_blocking=True)
    with torch.cuda.stream(d2h_stream):
        pinned2.copy_(dev2, non_blocking=True)
res["H2D+D2H at once (sum)"] = gbs(2 * nbytes, median_s(both))
for k, v in res.items():
    print(f"{k:<24} {v:7.1f} GB/s")
print(f"pinned/pageable          H2D {res['H2D pinned'] / res['H2D pageable']:.2f}x, "
      f"D2H {res['D2H pinned'] / res['D2H pageable']:.2f}x")
print(f"RESULT h2d_gbs={res['H2D pinned']:.1f} d2h_gbs={res['D2H pinned']:.1f}")
del dev, dev2, pinned, pinned2, pageable

n = 1 << 27  # a 128M-element bf16 gradient bucket (256 MiB) -> fp32 staging copy (512 MiB)
grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
moved = n * (2 + 4)
for where, out in (("pinned host", torch.empty(n).pin_memory()), ("device", torch.empty(n, device="cuda"))):
    fused = median_s(lambda: grad_bucket_pass(grad, out, use_kernel=True))
    ref = median_s(lambda: grad_bucket_pass_reference(grad, out))
    print(f"grad bucket pass -> {where:<11}: fused kernel {gbs(moved, fused):7.1f} GB/s, torch ops "
          f"{gbs(moved, ref):7.1f} GB/s, fused/torch speed {ref / fused:.2f}x")
EOF
}

stage_nvme() {
  "$PY" - "$NVME_DIR/aio" <<'EOF'
import os, sys, time
import torch
from zeroinf.io import AsyncIOHandle

d = sys.argv[1]
os.makedirs(d, exist_ok=True)
chunk, k = 256 << 20, 8
bufs = [torch.full((chunk,), i + 1, dtype=torch.uint8).pin_memory() for i in range(k)]
for i, b in enumerate(bufs):
    b[: 4096] = torch.randint(0, 256, (4096,), dtype=torch.uint8)
h = AsyncIOHandle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
print(h)
paths = [os.path.join(d, f"chunk{i}") for i in range(k)]
t = time.perf_counter()
for b, p in zip(bufs, paths):
    h.async_pwrite(b, p)
h.wait()
os.sync()
w = k * chunk / (time.perf_counter() - t) / 1e9
back = [torch.zeros(chunk, dtype=torch.uint8).pin_memory() for _ in range(k)]
t = time.perf_counter()
for b, p in zip(back, paths):
    h.async_pread(b, p)
h.wait()
r = k * chunk / (time.perf_counter() - t) / 1e9
assert all(torch.equal(a, b) for a, b in zip(bufs, back)), "NVMe read-back differs from what was written"
print(f"NVMe write {w:.2f} GB/s, read {r:.2f} GB/s ({k * chunk >> 20} MiB, bytes read back equal)")
print(f"RESULT nvme_write_gbs={w:.2f} nvme_read_gbs={r:.2f}")
for p in paths:
    os.remove(p)
EOF
}

stage_compare() {
  "$PY" -m zeroinf train --model llama --size tiny --offload infinity --nvme-path "$NVME_DIR/compare" \
    --steps 3 --dtype bf16 --compare --no-plot --out "$OUT_DIR/compare" 2>&1 | tail -n 25
}

stage_syncs() {
  "$PY" - "$NVME_DIR/syncs" <<'EOF'
import json, os, sys, warnings
import torch
import zeroinf
from zeroinf.models import build_config, build_model

nvme = sys.argv[1]
os.makedirs(nvme, exist_ok=True)
with open(os.path.join(os.path.dirname(zeroinf.__file__), "presets", "infinity.json")) as f:
    cfg = json.load(f)
cfg["bf16"] = {"enabled": True}
cfg["train_micro_batch_size_per_gpu"] = 2
for k in ("offload_param", "offload_optimizer"):
    cfg["zero_optimization"][k]["nvme_path"] = nvme
model = build_model(build_config("llama", "tiny", 256, 64, None), 0, None)
engine, *_ = zeroinf.initialize(model=model, model_parameters=model.parameters(), config=cfg)
x = torch.randint(0, 256, (2, 64), device="cuda")
counts = []
for step in range(3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if step > 0:  # step 1 records the trace and builds buffers
            torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    counts.append(len(syncs))
    for w in syncs[:3]:
        print(f"  step {step + 1}: {w.filename}:{w.lineno}: {str(w.message)[:100]}")
print(f"synchronising calls per step (step 1 not checked): {counts[1:]}")
print(f"RESULT syncs_per_step={max(counts[1:])}")
EOF
}

stage_train1b() {
  "$PY" -m zeroinf train --model llama --size 1b --offload infinity --nvme-path "$NVME_DIR/train1b" \
    --steps "${STEPS_1B:-3}" --seq-len "${SEQ_1B:-512}" --micro-batch "${MICRO_BATCH_1B:-4}" --dtype bf16 \
    --no-plot --out "$OUT_DIR/train1b" 2>&1 | tail -n 30
  local rc=${PIPESTATUS[0]}
  "$PY" - "$OUT_DIR/train1b/log.jsonl" <<'EOF'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
timed = recs[1:] or recs  # step 1 includes the trace and buffer set-up
med = sorted(r["step_s"] for r in timed)[len(timed) // 2]
wait = sum(r["io_wait_s"] for r in timed) / sum(r["step_s"] for r in timed)
print(f"steps {len(recs)}, median step {med:.2f} s (steps 2..), {timed[-1]['tokens_per_s']:.0f} tokens/s, "
      f"I/O wait {100 * wait:.1f}% of the step, loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}")
def nvme_bytes(r):  # the engine's stats() counters are per step ("of the last optimizer step")
    e = r.get("engine") or {}
    return sum(v for k, v in e.items() if "nvme" in k and "byte" in k and isinstance(v, (int, float)))
moved, secs = sum(nvme_bytes(r) for r in timed), sum(r["step_s"] for r in timed)
if moved > 0:
    print(f"NVMe traffic during training {moved / 1e9:.1f} GB in {secs:.1f} s = {moved / secs / 1e9:.2f} GB/s "
          f"(whole step; the engine's *nvme*byte* counters)")
else:
    print("NVMe GB/s during training: n/a (the engine's stats() has no *nvme*byte* counters)")
print(f"RESULT step_s={med:.2f} io_wait_share={wait:.3f}")
EOF
  return $rc
}

export -f stage_env stage_build stage_tests stage_transfers stage_nvme stage_compare stage_syncs stage_train1b
run_stage env 30 stage_env
run_stage build 180 stage_build
run_stage tests 90 stage_tests
run_stage transfers 60 stage_transfers
run_stage nvme 45 stage_nvme
run_stage compare 60 stage_compare
run_stage syncs 45 stage_syncs
run_stage train1b 400 stage_train1b

rm -rf "$NVME_DIR"
echo; echo "=== summary ($(($(date +%s) - _GPU_CHECK_T0)) s of ${BUDGET_S} s) ==="
printf '%s\n' "${SUMMARY[@]}"
grep -h "^RESULT" "$OUT_DIR/gpu_check.log" 2>/dev/null | sed 's/^RESULT /  /'
