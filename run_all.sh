#!/usr/bin/env bash
# Run every script of the collection once and print one summary table.
#
#   bash run_all.sh          # smoke settings: all GPUs on NCCL, or 2 CPU processes on gloo
#   bash run_all.sh --full   # the tutorials' own settings (10 and 30 epochs), no time limit
#   bash run_all.sh --bench [--bench-batch N]   # DataParallel vs DDP images/s, in bench.md
# Keeps going after a failure; exits 1 if any run failed. Logs, metrics and the last run's
# checkpoints go to runs/ (RUNS_DIR); each run gets RUN_TIMEOUT seconds (default 900, 0: none).
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
cd "$(dirname "$0")" || exit 1
PY=${PYTHON:-python3} RUNS=${RUNS_DIR:-runs}
TIMEOUT=${RUN_TIMEOUT:-$([ "$mode" = full ] && echo 0 || echo 900)}
mkdir -p "$RUNS" && : >"$RUNS/runs.tsv" || exit 1  # a line per run, for the table
info=$("$PY" -c 'import torch, torchvision as tv
names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
print(torch.cuda.device_count(), torch.__version__, tv.__version__, " + ".join(sorted(names)))') ||
  die 1 "torch and torchvision do not import in $PY: pip install -r requirements.txt"
read -r gpus torch_version tv_version gpu_names <<<"$info"
[ "$gpus" -gt 0 ] || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU' ||
  echo "run_all: nvidia-smi lists GPUs, torch $torch_version sees none (see the README); on CPU" >&2
nprocs=$gpus backend=nccl place=()
[ "$gpus" -gt 0 ] || nprocs=2 backend=gloo place=(--cpu)
stop() {  # Ctrl-C or TERM: stop the run in progress
  kill -TERM "$child" 2>/dev/null  # timeout passes it on to the whole group
  wait
  kill -KILL -- -"$child" 2>/dev/null
  exit 130
}
trap stop INT TERM
# run COL1 COL2 COL3 COL4 NOTE CMD...: one run for the table, under `timeout` (a process group)
run() {
  echo "--- $1 $2 $3: ${*:6}"
  local base=$RUNS/${1%.py}_$2_$3 start=$(date +%s.%N)
  rm -rf "$RUNS/ckpt" "$base.json"  # ckpt: a fresh run refuses a folder holding epoch_*.pt
  timeout --kill-after=10 "$TIMEOUT" "${@:6}" --metrics-out "$base.json" >"$base.log" 2>&1 &
  child=$!
  wait "$child"
  status=$?
  kill -KILL -- -"$child" 2>/dev/null  # ranks that a killed launcher left behind
  child=
  [ "$status" -eq 0 ] || tail -n 5 "$base.log" | sed 's/^/    /'
  echo "$(printf '%s\t' "${@:1:5}" "$status" "$start" "$(date +%s.%N)")$base" >>"$RUNS/runs.tsv"
}
if [ "$mode" = bench ]; then  # images/s without the warm-up, from the progress lines
  batch=${bench_batch:-256} counts=$(seq 1 "$gpus") precisions="fp32 amp+channels-last"
  setup=(--arch resnet50 --image-size 224 --workers 0 --epochs 2 --max-steps 50) every=5 unit=GPUs
  about="$gpus x $gpu_names | resnet50, 224 px, synthetic, batch $batch per GPU, 2nd epoch's images/s"
  if [ "$gpus" -eq 0 ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(($(nproc) > 1 ? $(nproc) / 2 : 1))}  # as 2 devices
    batch=${bench_batch:-8} counts="1 2" precisions=fp32 every=10 unit=processes
    setup=(--cpu --arch resnet18 --image-size 32 --workers 0 --epochs 1 --max-steps 20)
    about="CPU: $(sed -n '/^model name/{s/.*: //p;q}' /proc/cpuinfo), $(env -u OMP_NUM_THREADS nproc) cores"
    about+=" | resnet18, 32 px, batch $batch per process of $OMP_NUM_THREADS thread(s), steps 10 to 20"
  fi
  for prec in $precisions; do
    [ "$prec" = fp32 ] && flags=() || flags=(--amp --channels-last)
    for n in $counts; do
      run ddp_resnet.py "$n" "$prec" - $((batch * n)) "$PY" ddp_resnet.py --nprocs "$n" \
        --batch-size "$batch" --log-every "$every" "${flags[@]}" "${setup[@]}" --ckpt-dir "$RUNS/ckpt"
      [ "$gpus" -gt 0 ] || [ "$n" -eq 1 ] || continue  # on CPU: DataParallel's baseline, 1 process
      run dp_resnet.py "$n" "$prec" - $((batch * n)) env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" \
        "$PY" dp_resnet.py --batch-size $((batch * n)) "${flags[@]}" "${setup[@]}" --ckpt-dir "$RUNS/ckpt"
    done
  done
  rm -rf "$RUNS/ckpt"
else
  # FashionMNIST: ./data; else Debian's dataset-fashion-mnist, unzipped there; else a download
  raw=data/FashionMNIST/raw debian=/usr/share/datasets/fashion-mnist fm_data=(--data data)
  for f in {train,t10k}-{images-idx3,labels-idx1}-ubyte; do
    if [ ! -s "$raw/$f" ] && [ -f "$debian/$f.gz" ]; then
      mkdir -p "$raw" && gunzip -c "$debian/$f.gz" >"$raw/$f.part" && mv "$raw/$f.part" "$raw/$f"
    fi
  done
  if ! ls "$raw"/{train,t10k}-{images-idx3,labels-idx1}-ubyte &>/dev/null && ! "$PY" -c \
    '__import__("torchvision").datasets.FashionMNIST("data", download=True)' &>"$RUNS/download.log"; then
    fm_data=(--synthetic) fm_note="SYNTHETIC: no FashionMNIST found, none downloaded"
  fi
  fm_flags=(--epochs 1) resnet_flags=(--arch resnet18 --image-size 32 --epochs 2 --max-steps 3)
  dp_flags=(--batch-size $((gpus > 2 ? 4 * gpus : 8))) ddp_flags=(--batch-size 8 --log-every 1)
  [ "$mode" = smoke ] || fm_flags=() resnet_flags=() dp_flags=() ddp_flags=()
  run ddp_gather.py spawn "$nprocs" $backend "" "$PY" ddp_gather.py "${place[@]}" --nprocs "$nprocs"
  run ddp_gather.py torchrun "$nprocs" $backend "" "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node="$nprocs" ddp_gather.py "${place[@]}"
  run ddp_fashionmnist.py spawn "$nprocs" $backend "${fm_note:-real data}" "$PY" ddp_fashionmnist.py \
    "${place[@]}" --nprocs "$nprocs" "${fm_data[@]}" "${fm_flags[@]}"
  run dp_resnet.py single $((gpus > 0 ? gpus : 1)) none "" "$PY" dp_resnet.py "${place[@]}" \
    --ckpt-dir "$RUNS/ckpt" "${resnet_flags[@]}" "${dp_flags[@]}"
  run ddp_resnet.py spawn "$nprocs" $backend "" "$PY" ddp_resnet.py "${place[@]}" \
    --nprocs "$nprocs" --ckpt-dir "$RUNS/ckpt" "${resnet_flags[@]}" "${ddp_flags[@]}"
fi
exec "$PY" - "$mode" "$RUNS" "${unit:-}" \
  "bench | ${about:-} | torch $torch_version | torchvision $tv_version" <<'EOF'
import json, re, sys
mode, runs_dir, unit, header = sys.argv[1:]
# bench: from the first to the last progress line of the last epoch, where an epoch after the
# first starts warm: its start counts as a line
LINE = r"^epoch (\d+)/\d+ \| step (\d+)/\d+ \| loss \S+ \| ([\d.]+) img/s(?: \| ([\d.]+) s)?"
def images_per_sec(log, batch):
    epochs = {}
    for e, s, r, x in re.findall(LINE, open(log, errors="replace").read(), re.M):
        t = int(s) * batch / float(r)  # since the epoch began: from R, within ddp's X.X s
        t = min(max(t, float(x) - 0.05), float(x) + 0.05) if x else t
        epochs.setdefault(int(e), [(0, 0)] * (e != "1")).append((int(s) * batch, t))
    (s1, u1), (s2, u2) = (epochs[max(epochs)][i] for i in (0, -1)) if epochs else [(0, 0)] * 2
    return (s2 - s1) / (u2 - u1) if u2 > u1 else "FAILED (too few progress lines)"
def result(base, note):  # what a run's metrics say
    try:
        m = json.load(open(base + ".json"))
    except (OSError, ValueError):
        return "FAILED (no metrics)"
    parts = [f"{k} {m[k]:.4g}" for k in ("test_accuracy", "images_per_sec", "final_loss") if k in m]
    parts += [f"gathered ranks {[g['dict']['rank'] for g in m['gathered']]}"] if "gathered" in m else []
    return "ok: " + ", ".join(parts + [note] * bool(note))
ratio = lambda a, b, n=1: f"{a / b / n:.2f}" if isinstance(a, float) and isinstance(b, float) else "-"
cells = {}  # (script, column 2, column 3): result or images/s
table = ["| script | launch | world | backend | seconds | result |", "| --- | --- | ---: | --- | ---: | --- |"]
for line in open(f"{runs_dir}/runs.tsv"):
    name, a, b, backend, note, status, start, end, base = line.rstrip("\n").split("\t")
    v = images_per_sec(base + ".log", int(note)) if mode == "bench" else result(base, note)
    cells[name, a, b] = v = v if status == "0" else f"FAILED (exit {status})"
    table.append(f"| {name} | {a} | {b} | {backend} | {float(end) - float(start):.1f} | {v} |")
if mode == "bench":
    table = [header, "", f"| {unit} | mode | precision | images/s | scaling vs 1 | DDP/DP |",
             "| ---: | --- | --- | ---: | ---: | ---: |"]
    for (name, n, prec), v in cells.items():
        vs_dp = ratio(v, cells.get(("dp_resnet.py", n, prec))) if name == "ddp_resnet.py" else "-"
        table.append(f"| {n} | {name.split('_')[0]} | {prec} | {v if isinstance(v, str) else f'{v:.1f}'}"
                     f" | {ratio(v, cells[name, '1', prec], int(n))} | {vs_dp} |")
    open(f"{runs_dir}/bench.md", "w").write("\n".join(table) + "\n")
failed = sum(str(v).startswith("FAILED") for v in cells.values())
print("\n" + "\n".join(table) + "\n")
print(f"run_all: {failed} of {len(cells)} runs FAILED" if failed else f"run_all: all {len(cells)} runs passed")
sys.exit(1 if failed else 0)
EOF
