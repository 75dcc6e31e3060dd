#!/usr/bin/env bash
# Run every script of the collection once and print one summary table.
#
#   bash run_all.sh          # smoke settings: all GPUs on NCCL, or 2 CPU processes on gloo
#   bash run_all.sh --full   # the tutorials' own settings (10 and 30 epochs), no time limit
#   bash run_all.sh --bench [--bench-batch N]   # DataParallel vs DDP images/s, in bench.md
# Keeps going after a failure; exits 1 if any run failed. Each call writes its logs, metrics,
# checkpoints and table into a new folder of its own under runs/ (RUNS_DIR), and removes
# nothing it did not make; each run gets RUN_TIMEOUT seconds (default 900, 0: none).
set -u
die() {  # die EXIT_CODE MESSAGE
  echo "run_all: $2" >&2
  exit "$1"
}
mode=smoke bench_batch= child=
while [ $# -gt 0 ]; do
  case $1 in
    --full | --bench) mode=${1#--} ;;
    --bench-batch) bench_batch=${2:-missing} ;;
    -h | --help) exec sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0" ;;
    *) die 2 "unknown option $1 (see --help)" ;;
  esac
  [ "$1" != --bench-batch ] || shift  # its value
  shift
done
[[ ${bench_batch:-1} =~ ^[1-9][0-9]*$ ]] || die 2 "--bench-batch N: N a whole number above 0"
[ -z "$bench_batch" ] || [ "$mode" = bench ] || die 2 "--bench-batch goes with --bench"
case ${RUNS_DIR:-} in /* | "") ;; *) RUNS_DIR=$PWD/$RUNS_DIR ;; esac  # relative: to where you are
cd "$(dirname "$0")" || exit 1
PY=${PYTHON:-python3} RUNS=${RUNS_DIR:-runs}
TIMEOUT=${RUN_TIMEOUT:-$([ "$mode" = full ] && echo 0 || echo 900)}
info=$("$PY" -c 'import torch, torchvision as tv
names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
print(torch.cuda.device_count(), torch.__version__, tv.__version__, " + ".join(sorted(names)))') ||
  die 1 "torch and torchvision do not import in $PY: pip install -r requirements.txt"
read -r gpus torch_version tv_version gpu_names <<<"$info"
[ "$gpus" -gt 0 ] || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU' ||
  echo "run_all: nvidia-smi lists GPUs, torch $torch_version sees none (see the README); on CPU" >&2
# this call's own folder: two calls at once, or an earlier call's files, never mix
mkdir -p "$RUNS" && out=$(mktemp -d "$RUNS/$(date +%Y%m%d-%H%M%S)-XXXX") || exit 1
nprocs=$gpus backend=nccl place=()
[ "$gpus" -gt 0 ] || nprocs=2 backend=gloo place=(--cpu)
stop() {  # Ctrl-C or TERM: stop the run in progress
  kill -TERM "$child" 2>/dev/null  # timeout passes it on to the whole group
  wait
  kill -KILL -- -"$child" 2>/dev/null
  exit 130
}
trap stop INT TERM
# run COL1 COL2 COL3 COL4 NOTE CMD...: one run for the table, under `timeout` (a process group),
# with a checkpoint folder of its own
run() {
  echo "--- $1 $2 $3: ${*:6}"
  local base=$out/${1%.py}_$2_$3 start=$(date +%s.%N)
  timeout --kill-after=10 "$TIMEOUT" "${@:6}" --metrics-out "$base.json" >"$base.log" 2>&1 &
  child=$!
  wait "$child"
  status=$?
  kill -KILL -- -"$child" 2>/dev/null  # ranks that a killed launcher left behind
  child=
  [ "$status" -eq 0 ] || tail -n 5 "$base.log" | sed 's/^/    /'
  echo "$(printf '%s\t' "${@:1:5}" "$status" "$start" "$(date +%s.%N)")$base" >>"$out/runs.tsv"
}
if [ "$mode" = bench ]; then  # images/s of the 2nd epoch, which starts warm
  batch=${bench_batch:-256} counts=$(seq 1 "$gpus") precisions="fp32 amp+channels-last"
  setup=(--arch resnet50 --image-size 224 --workers 0 --epochs 2 --max-steps 50) unit=GPUs
  about="$gpus x $gpu_names | resnet50, 224 px, synthetic, batch $batch per GPU, 2nd epoch's images/s"
  if [ "$gpus" -eq 0 ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(($(nproc) > 1 ? $(nproc) / 2 : 1))}  # as 2 devices
    batch=${bench_batch:-8} counts="1 2" precisions=fp32 unit=processes
    setup=(--cpu --arch resnet18 --image-size 32 --workers 0 --epochs 2 --max-steps 10)
    about="CPU: $(sed -n '/^model name/{s/.*: //p;q}' /proc/cpuinfo), $(env -u OMP_NUM_THREADS nproc) cores"
    about+=" | resnet18, 32 px, batch $batch per process of $OMP_NUM_THREADS thread(s), 2nd epoch"
  fi
  for prec in $precisions; do
    [ "$prec" = fp32 ] && flags=() || flags=(--amp --channels-last)
    for n in $counts; do
      run ddp_resnet.py "$n" "$prec" - "" "$PY" ddp_resnet.py --nprocs "$n" --batch-size "$batch" \
        "${flags[@]}" "${setup[@]}" --ckpt-dir "$out/ddp_${n}_$prec.ckpt"
      [ "$gpus" -gt 0 ] || [ "$n" -eq 1 ] || continue  # on CPU: DataParallel's baseline, 1 process
      run dp_resnet.py "$n" "$prec" - "" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" "$PY" \
        dp_resnet.py --batch-size $((batch * n)) "${flags[@]}" "${setup[@]}" --ckpt-dir "$out/dp_${n}_$prec.ckpt"
    done
  done
  rm -rf "$out"/*.ckpt  # the bench's own checkpoints, hundreds of MB each on GPUs
else
  # FashionMNIST: ./data; else Debian's dataset-fashion-mnist, unzipped there; else a download
  raw=data/FashionMNIST/raw debian=/usr/share/datasets/fashion-mnist fm_data=(--data data)
  for f in {train,t10k}-{images-idx3,labels-idx1}-ubyte; do
    if [ ! -s "$raw/$f" ] && [ -f "$debian/$f.gz" ]; then
      mkdir -p "$raw" && gunzip -c "$debian/$f.gz" >"$raw/$f.part" && mv "$raw/$f.part" "$raw/$f"
    fi
  done
  if ! ls "$raw"/{train,t10k}-{images-idx3,labels-idx1}-ubyte &>/dev/null && ! "$PY" -c \
    '__import__("torchvision").datasets.FashionMNIST("data", download=True)' &>"$out/download.log"; then
    fm_data=(--synthetic) fm_note="SYNTHETIC: no FashionMNIST found, none downloaded"
  fi
  fm_flags=(--epochs 1) resnet_flags=(--arch resnet18 --image-size 32 --epochs 2 --max-steps 3)
  dp_flags=(--batch-size $((gpus > 2 ? 4 * gpus : 8))) ddp_flags=(--batch-size 8)
  [ "$mode" = smoke ] || fm_flags=() resnet_flags=() dp_flags=() ddp_flags=()
  run ddp_gather.py spawn "$nprocs" $backend "" "$PY" ddp_gather.py "${place[@]}" --nprocs "$nprocs"
  run ddp_gather.py torchrun "$nprocs" $backend "" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node="$nprocs" ddp_gather.py "${place[@]}"
  run ddp_fashionmnist.py spawn "$nprocs" $backend "${fm_note:-real data}" "$PY" ddp_fashionmnist.py \
    "${place[@]}" --nprocs "$nprocs" "${fm_data[@]}" "${fm_flags[@]}"
  run dp_resnet.py single $((gpus > 0 ? gpus : 1)) none "" "$PY" dp_resnet.py "${place[@]}" \
    --ckpt-dir "$out/dp_resnet.ckpt" "${resnet_flags[@]}" "${dp_flags[@]}"
  run ddp_resnet.py spawn "$nprocs" $backend "" "$PY" ddp_resnet.py "${place[@]}" \
    --nprocs "$nprocs" --ckpt-dir "$out/ddp_resnet.ckpt" "${resnet_flags[@]}" "${ddp_flags[@]}"
fi
exec "$PY" - "$mode" "$out" "${unit:-}" \
  "bench | ${about:-} | torch $torch_version | torchvision $tv_version" <<'EOF'
import json, sys
mode, out, unit, header = sys.argv[1:]
def result(base, note):  # what a run's metrics say
    try:
        m = json.load(open(base + ".json"))
    except (OSError, ValueError):
        return "FAILED (no metrics)"
    if mode == "bench":
        return m["images_per_sec"]
    parts = [f"{k} {m[k]:.4g}" for k in ("test_accuracy", "images_per_sec", "final_loss") if k in m]
    if "gathered" in m:
        parts.append(f"gathered ranks {[g['dict']['rank'] for g in m['gathered']]}")
    return "ok: " + ", ".join(parts + ([note] if note else []))
def ratio(a, b, n=1):
    ok = isinstance(a, float) and isinstance(b, float)
    return f"{a / b / n:.2f}" if ok else "-"
cells = {}  # (script, column 2, column 3): result or images/s
table = ["| script | launch | world | backend | seconds | result |", "| --- | --- | ---: | --- | ---: | --- |"]
for line in open(f"{out}/runs.tsv"):
    name, a, b, backend, note, status, start, end, base = line.rstrip("\n").split("\t")
    cells[name, a, b] = v = result(base, note) if status == "0" else f"FAILED (exit {status})"
    table.append(f"| {name} | {a} | {b} | {backend} | {float(end) - float(start):.1f} | {v} |")
if mode == "bench":
    table = [header, "", f"| {unit} | mode | precision | images/s | scaling vs 1 | DDP/DP |",
             "| ---: | --- | --- | ---: | ---: | ---: |"]
    for (name, n, prec), v in cells.items():
        vs_dp = ratio(v, cells.get(("dp_resnet.py", n, prec))) if name == "ddp_resnet.py" else "-"
        shown = v if isinstance(v, str) else f"{v:.1f}"
        scaling = ratio(v, cells[name, "1", prec], int(n))
        table.append(f"| {n} | {name.split('_')[0]} | {prec} | {shown} | {scaling} | {vs_dp} |")
    open(f"{out}/bench.md", "w").write("\n".join(table) + "\n")
failed = sum(str(v).startswith("FAILED") for v in cells.values())
print("\n" + "\n".join(table) + "\n")
print(f"run_all: logs, metrics and checkpoints in {out}")
print(f"run_all: {failed} of {len(cells)} runs FAILED" if failed else f"run_all: all {len(cells)} runs passed")
sys.exit(1 if failed else 0)
EOF
