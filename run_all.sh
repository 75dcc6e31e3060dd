#!/usr/bin/env bash
# Run every script of the collection once and print one summary table.
#
#   bash run_all.sh          # short smoke settings: all GPUs on NCCL, or 2 processes on gloo/CPU
#   bash run_all.sh --full   # the tutorials' own settings (long: 10 and 30 epochs)
#
# Keeps going after a failure; exits non-zero if any run failed. Logs and metrics go to
# runs/ (RUNS_DIR to change it); RUN_TIMEOUT caps each run in seconds (default 900, 0: none).
set -u
cd "$(dirname "$0")"
mode=smoke
for arg in "$@"; do
  case "$arg" in
    --full) mode=full ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $arg (use --full, or nothing)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
RUNS=${RUNS_DIR:-runs}
TIMEOUT=${RUN_TIMEOUT:-900}
[ "$mode" = full ] && TIMEOUT=${RUN_TIMEOUT:-0}
mkdir -p "$RUNS"

# Each run goes under `timeout`, which puts it in a process group of its own and signals that
# whole group: a stopped runner or a run past its time leaves no rank behind.
child=
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; wait; exit 130' INT TERM

if ! gpus=$("$PY" -c 'import torch, torchvision; print(torch.cuda.device_count())' 2>"$RUNS/import.log"); then
  echo "error: torch/torchvision do not import (see $RUNS/import.log); run: pip install -r requirements.txt" >&2
  exit 1
fi
if [ "$gpus" -gt 0 ]; then
  nprocs=$gpus; place=(); backend=nccl
else
  nprocs=2; place=(--cpu); backend=gloo
fi
echo "run_all: $mode run, $([ "$gpus" -gt 0 ] && echo "$gpus GPU(s), NCCL" || echo "no GPU, 2 CPU processes on gloo")"

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
  resnet_flags=(--image-size 64 --batch-size 8 --epochs 2 --max-steps 3 --log-every 1 --warmup-steps 1)
else
  fm_flags=(); resnet_flags=()
fi

rows=()
failed=0
# run NAME LAUNCH WORLD BACKEND NOTE CMD...: time one run, read its metrics, add a table row.
run() {
  local name=$1 launch=$2 world=$3 be=$4 note=$5; shift 5
  local log="$RUNS/${name%.py}_$launch.log" json="$RUNS/${name%.py}_$launch.json" start end status result
  rm -f "$json"
  echo "--- $name: $*"
  start=$(date +%s.%N)
  timeout --kill-after=10 "$TIMEOUT" "$@" --metrics-out "$json" >"$log" 2>&1 &  # 0: no limit
  child=$!
  wait "$child"
  status=$?
  child=
  end=$(date +%s.%N)
  if [ $status -eq 0 ] && [ -s "$json" ]; then
    result=$("$PY" - "$json" "$note" <<'EOF'
import json, sys
m, note = json.load(open(sys.argv[1])), sys.argv[2]
keys = ("test_accuracy", "images_per_sec", "final_loss")
parts = [f"{k} {m[k]:.4g}" for k in keys if isinstance(m.get(k), (int, float))]
if "gathered" in m:
    parts.append(f"gathered {len(m['gathered'])} objects in rank order: {m.get('in_rank_order')}")
print("ok: " + ", ".join(parts + ([note] if note else [])))
EOF
)
  else
    result="FAILED (exit $status), see $log"
    failed=$((failed + 1))
    tail -n 5 "$log" | sed 's/^/    /'
  fi
  rows+=("$(printf '| %-20s | %-8s | %5s | %-7s | %7.1f | %s |' "$name" "$launch" "$world" "$be" \
             "$(awk "BEGIN {print $end - $start}")" "$result")")
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
