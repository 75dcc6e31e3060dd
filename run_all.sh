#!/usr/bin/env bash
# Run every script of the collection once and print one summary table.
#
#   bash run_all.sh          # short smoke settings: all GPUs on NCCL, or 2 processes on gloo/CPU
#   bash run_all.sh --full   # the tutorials' own settings (long: 10 and 30 epochs)
#   bash run_all.sh --bench  # images/s of DataParallel vs DDP: one Markdown table, also in runs/bench.md
#
# Keeps going after a failure; exits non-zero if any run failed. Logs and metrics go to
# runs/ (RUNS_DIR to change it); RUN_TIMEOUT caps each run in seconds (default 900, 0: none).
#
# --bench measures, on synthetic data with the same batch per GPU (--bench-batch N, default 256):
# the plain model on one GPU (dp_resnet.py --no-wrap), then dp_resnet.py and ddp_resnet.py on
# 1..N GPUs (all visible; CUDA_VISIBLE_DEVICES to choose), each in default precision and with
# --amp --channels-last; ResNet50, 224 px, images/s over 50 steps after 10 warm-up steps.
# Without a GPU it runs a tiny CPU version on gloo (resnet18, 32 px, batch 8, 1 and 2 processes
# of half the cores each, default precision only: bf16 on a CPU says nothing about a GPU).
set -u
cd "$(dirname "$0")"
mode=smoke
bench_batch=
while [ $# -gt 0 ]; do
  case "$1" in
    --full) mode=full ;;
    --bench) mode=bench ;;
    --bench-batch) bench_batch=${2:-none}; shift ;;
    --bench-batch=*) bench_batch=${1#*=}; bench_batch=${bench_batch:-none} ;;
    -h|--help) sed -n '2,/^[^#]/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
    *) echo "error: unknown option $1 (use --full, --bench [--bench-batch N], or nothing)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$bench_batch" ] && { [ $mode != bench ] || ! [[ "$bench_batch" =~ ^[1-9][0-9]*$ ]]; }; then
  echo "error: --bench-batch N goes with --bench, N a positive whole number (got: $bench_batch)" >&2; exit 2
fi

PY=${PYTHON:-python3}
RUNS=${RUNS_DIR:-runs}
TIMEOUT=${RUN_TIMEOUT:-900}
[ "$mode" = full ] && TIMEOUT=${RUN_TIMEOUT:-0}
mkdir -p "$RUNS"

# Each run goes under `timeout`, which puts it in a process group of its own and signals that
# whole group: a stopped runner or a run past its time leaves no rank behind.
child=
scratch=
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; wait; [ -n "$scratch" ] && rm -rf "$scratch"; exit 130' INT TERM

if ! info=$("$PY" -c 'import torch, torchvision as tv; print(torch.cuda.device_count(), torch.__version__, tv.__version__)' \
            2>"$RUNS/import.log"); then
  echo "error: torch/torchvision do not import (see $RUNS/import.log); run: pip install -r requirements.txt" >&2
  exit 1
fi
read -r gpus torch_version torchvision_version <<<"$info"
if [ "$gpus" -eq 0 ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "run_all: nvidia-smi lists GPUs, torch $torch_version sees none (CUDA_VISIBLE_DEVICES hides" \
       "them, a CPU-only torch, or a torch built for a newer driver: see the README); on CPU" >&2
fi
if [ "$gpus" -gt 0 ]; then
  nprocs=$gpus; place=(); backend=nccl
else
  nprocs=2; place=(--cpu); backend=gloo
fi
echo "run_all: $mode run, $([ "$gpus" -gt 0 ] && echo "$gpus GPU(s), NCCL" || echo "no GPU, 2 CPU processes on gloo")"

# timed LOG JSON CMD...: run CMD --metrics-out JSON under `timeout`, output to LOG; sets status and seconds.
timed() {
  local log=$1 json=$2 start; shift 2
  rm -f "$json"
  start=$(date +%s.%N)
  timeout --kill-after=10 "$TIMEOUT" "$@" --metrics-out "$json" >"$log" 2>&1 &  # 0: no limit
  child=$!
  wait "$child"
  status=$?
  child=
  seconds=$(awk "BEGIN {print $(date +%s.%N) - $start}")
}

if [ "$mode" = bench ]; then
  if [ "$gpus" -gt 0 ]; then
    batch=${bench_batch:-256} steps=60 warmup=10 every=10 counts=$(seq 1 "$gpus") precisions="default amp"
    setup=(--arch resnet50 --image-size 224 --workers 0)  # in-memory images: workers would only copy them
  else
    batch=${bench_batch:-8} steps=8 warmup=2 every=2 counts="1 2" precisions=default
    setup=(--cpu --arch resnet18 --image-size 32 --workers 0)
    # one CPU "device": a process with half the cores, so 1 and 2 processes compare like 1 and 2 GPUs
    threads=$(( $(nproc) / 2 )); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
  fi
  setup+=(--epochs 1 --max-steps "$steps" --warmup-steps "$warmup" --log-every "$every")
  scratch=$(mktemp -d "$RUNS/bench_ckpt.XXXXXX")  # checkpoints (200 MB each for resnet50): deleted after each run
  listing="$RUNS/bench_runs.tsv"
  : >"$listing"
  # bench MODE N PRECISION CMD...: one measured run; its metrics file is listed for the table.
  bench() {
    local mode=$1 n=$2 prec=$3 tag="bench_$1_x$2_$3"; shift 3
    echo "--- bench $mode x$n $prec: $*"
    timed "$RUNS/$tag.log" "$RUNS/$tag.json" "$@" "${setup[@]}" --synthetic-size $((batch * n * steps)) \
      --ckpt-dir "$scratch/$tag"
    rm -rf "${scratch:?}/$tag"
    [ $status -eq 0 ] || tail -n 5 "$RUNS/$tag.log" | sed 's/^/    /'
    printf '%s\t%s\t%s\t%s\t%s\n' "$mode" "$n" "$prec" "$status" "$RUNS/$tag.json" >>"$listing"
  }
  for prec in $precisions; do
    flags=(); [ $prec = amp ] && flags=(--amp --channels-last)
    bench plain 1 $prec "$PY" dp_resnet.py --no-wrap --batch-size "$batch" "${flags[@]}"
    for n in $counts; do
      [ "$gpus" -gt 0 ] && bench dp "$n" $prec "$PY" dp_resnet.py --gpus "$n" --batch-size $((batch * n)) "${flags[@]}"
      bench ddp "$n" $prec "$PY" ddp_resnet.py --nprocs "$n" --batch-size "$batch" "${flags[@]}"
    done
  done
  rm -rf "$scratch"
  scratch=
  echo
  "$PY" - "$listing" "$RUNS/bench.md" "$gpus" "torch $torch_version | torchvision $torchvision_version" "${OMP_NUM_THREADS:-}" \
    "$batch" "$steps" "$warmup" "$every" "${setup[@]}" <<'EOF'
import json, os, platform, sys
listing, out, gpus, versions, threads, batch, steps, warmup, every = sys.argv[1:10]
setup = " ".join(sys.argv[10:])
gpus, timed = int(gpus), int(steps) - int(warmup)
PRECISION = {"default": "default", "amp": "amp + channels-last"}
if gpus:
    import torch
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    machine = f"{gpus}x {' + '.join(names)}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
else:
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith("model name")), "")
    machine = (f"CPU: {model or platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU, "
               f"{threads} thread(s) per process")
rows, ips, failed = [], {}, 0
for line in open(listing):
    mode, n, prec, status, path = line.rstrip("\n").split("\t")
    try:
        m = json.load(open(path)) if status == "0" else {}
    except (OSError, ValueError):
        m = {}
    v = m.get("images_per_sec")
    ok = isinstance(v, (int, float)) and v > 0  # a run without a timed window measured nothing
    failed += not ok
    if ok:
        ips[mode, int(n), prec] = v
    why = {"0": "no images/s in its metrics", "124": "exit 124, timed out"}.get(status, f"exit {status}")
    rows.append((mode, int(n), prec, ok, m.get("max_memory_gib"), why))
rows.sort(key=lambda r: (list(PRECISION).index(r[2]), r[1], ["plain", "dp", "ddp"].index(r[0])))

def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"

lines = [f"bench | {machine} | {versions} | {setup}", "",
         "| GPUs | mode | precision | images/s | scaling vs 1 GPU | DDP / DP | peak mem/GPU (GiB) |",
         "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
for mode, n, prec, ok, mem, why in rows:
    v = ips.get((mode, n, prec))
    scaling = ratio(v, n * ips.get((mode, 1, prec), 0))
    vs_dp = ratio(v, ips.get(("dp", n, prec))) if mode == "ddp" and gpus else "n/a" if mode == "ddp" else "-"
    cells = [str(n) if gpus else f"{n} (CPU)", mode, PRECISION[prec],
             f"{v:.1f}" if ok else f"FAILED ({why})", scaling if ok else "-", vs_dp if ok else "-",
             f"{max(mem):.1f}" if ok and mem else "-"]
    lines.append("| " + " | ".join(cells) + " |")
each = "GPU" if gpus else "process"
run = sorted({r[2] for r in rows}, key=list(PRECISION).index)  # the precisions that ran
overhead = ", ".join(f"{PRECISION[p]} {ratio(ips.get(('ddp', 1, p)), ips.get(('plain', 1, p)))}" for p in run)
lines += ["", f"images/s: all {'GPUs' if gpus else 'processes'} together, synthetic in-memory images, batch {batch} per {each}"
              + (f" (DataParallel: one batch of {batch} x N)" if gpus else "")
              + f"; over the {timed} steps after {warmup} warm-up steps, "
              f"device synchronised before each clock read.",
          f"scaling vs 1 GPU = images/s / (N x images/s of the same mode and precision at N = 1). "
          f"DDP / DP = DDP images/s / DataParallel images/s at the same N and precision.",
          f"plain = dp_resnet.py --no-wrap: the torchvision model on one {'GPU' if gpus else 'CPU process'} without any "
          f"wrapper. DDP on 1 {each} / plain: {overhead}.",
          "precision: default = fp32" + (" (cuDNN may run convolutions in TF32, PyTorch's default); amp + "
          "channels-last = --amp --channels-last: bf16 autocast, NHWC tensors." if gpus else
          " only: bf16 autocast on a CPU says nothing about a GPU.")]
if gpus:
    lines.append("peak mem/GPU: torch.cuda.max_memory_allocated, the largest over the GPUs "
                 "(DataParallel gathers the outputs on GPU 0).")
else:
    lines.append("CPU: a tiny version of the GPU benchmark, so that CI runs the command; its figures describe "
                 f"this CPU only and compare with no GPU figure (nor with AIME's table). Each process runs "
                 f"{threads} thread(s) (OMP_NUM_THREADS), so scaling shows how DDP over gloo spreads over the "
                 f"cores, and says nothing about GPUs. DataParallel needs GPUs: no dp rows, hence DDP / DP n/a; "
                 f"the line above compares DDP with plain.")
print("\n".join(lines))
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"\nrun_all: bench table saved to {out}" + (f"; {failed} run(s) FAILED, see {os.path.dirname(out) or '.'}/bench_*.log" if failed else ""))
sys.exit(1 if failed else 0)
EOF
  exit $?
fi

# FashionMNIST: ./data, then Debian's dataset-fashion-mnist, then a download, else synthetic.
has_idx() { compgen -G "$1/t10k-labels-idx1-ubyte*" || compgen -G "$1/FashionMNIST/raw/t10k-labels-idx1-ubyte*"; } >/dev/null
debian=/usr/share/datasets/fashion-mnist
if has_idx data; then fm_data=(--data data); fm_note="real data, ./data"
elif has_idx "$debian"; then fm_data=(--data "$debian"); fm_note="real data, $debian"
elif "$PY" -c 'from torchvision import datasets as d; [d.FashionMNIST("data", train=t, download=True) for t in (1, 0)]' \
     >"$RUNS/download.log" 2>&1; then fm_data=(--data data); fm_note="real data, downloaded"
else fm_data=(--synthetic); fm_note="SYNTHETIC: no FashionMNIST found or downloadable"
fi

if [ "$mode" = smoke ]; then
  fm_flags=(--epochs 1)
  # resnet18 at 32 px: the same pattern as ResNet50 (--full), with 45 MB checkpoints, not 200
  resnet_flags=(--arch resnet18 --image-size 32 --batch-size 8 --epochs 2 --max-steps 3 --log-every 1 --warmup-steps 1)
else
  fm_flags=(); resnet_flags=()
fi

rows=()
failed=0
# run NAME LAUNCH WORLD BACKEND NOTE CMD...: time one run, read its metrics, add a table row.
run() {
  local name=$1 launch=$2 world=$3 be=$4 note=$5; shift 5
  local log="$RUNS/${name%.py}_$launch.log" json="$RUNS/${name%.py}_$launch.json" result
  echo "--- $name: $*"
  timed "$log" "$json" "$@"
  if [ $status -eq 0 ] && [ -s "$json" ]; then
    result=$("$PY" - "$json" "$note" <<'EOF'
import json, sys
m, note = json.load(open(sys.argv[1])), sys.argv[2]
keys = ("test_accuracy", "images_per_sec", "final_loss")
parts = [f"{k} {m[k]:.4g}" for k in keys if isinstance(m.get(k), (int, float))]
if "gathered" in m:
    in_order = [g["dict"]["rank"] for g in m["gathered"]] == list(range(m["world_size"]))
    parts.append(f"gathered {len(m['gathered'])} objects in rank order: {in_order}")
print("ok: " + ", ".join(parts + ([note] if note else [])))
EOF
)
  else
    result="FAILED (exit $status), see $log"
    failed=$((failed + 1))
    tail -n 5 "$log" | sed 's/^/    /'
  fi
  rows+=("$(printf '| %-20s | %-8s | %5s | %-7s | %7.1f | %s |' "$name" "$launch" "$world" "$be" \
             "$seconds" "$result")")
}

torchrun=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$nprocs")
[ -f ddp_gather.py ] && run ddp_gather.py spawn "$nprocs" "$backend" "" \
  "$PY" ddp_gather.py "${place[@]}" --nprocs "$nprocs"
[ -f ddp_gather.py ] && run ddp_gather.py torchrun "$nprocs" "$backend" "" \
  "${torchrun[@]}" ddp_gather.py "${place[@]}"
[ -f ddp_fashionmnist.py ] && run ddp_fashionmnist.py spawn "$nprocs" "$backend" "$fm_note" \
  "$PY" ddp_fashionmnist.py "${place[@]}" --nprocs "$nprocs" "${fm_data[@]}" "${fm_flags[@]}"
[ -f dp_resnet.py ] && run dp_resnet.py single "$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)" none "" \
  "$PY" dp_resnet.py "${place[@]}" --ckpt-dir "$RUNS/ckpt_dp" "${resnet_flags[@]}"
[ -f ddp_resnet.py ] && run ddp_resnet.py spawn "$nprocs" "$backend" "" \
  "$PY" ddp_resnet.py "${place[@]}" --nprocs "$nprocs" --ckpt-dir "$RUNS/ckpt_ddp" "${resnet_flags[@]}"

[ "$mode" = smoke ] && rm -rf "$RUNS/ckpt_dp" "$RUNS/ckpt_ddp"  # smoke checkpoints: proven, not kept
echo
echo "| script               | launch   | world | backend | seconds | result |"
echo "| -------------------- | -------- | ----- | ------- | ------- | ------ |"
printf '%s\n' "${rows[@]}"
echo
if [ $failed -gt 0 ]; then
  echo "run_all: $failed run(s) FAILED"
  exit 1
fi
echo "run_all: all ${#rows[@]} runs passed"
