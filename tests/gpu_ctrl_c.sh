#!/usr/bin/env bash
# Ctrl-C on a GPU, where the loader's workers and pin_memory run (not in the suite):
# SIGINT to the whole group of ddp_resnet.py and of dp_resnet.py, as a terminal sends it,
# mid-epoch, while the next epoch's workers start, and while a checkpoint is written (its
# .tmp past 1 MB). Each time: exit 130, no traceback, no process left, no .tmp. tests/gpu_check.sh runs it once; SRC: another folder's scripts.
#
#   bash tests/gpu_ctrl_c.sh [TIMES]
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3} SRC=${SRC:-.}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
small=(--arch resnet18 --image-size 64 --batch-size 64 --max-steps 20 --amp --channels-last)
for script in ddp_resnet.py dp_resnet.py; do
  for moment in "step 10/" "^epoch 1/[0-9]+ \| loss" "a save"; do
    for i in $(seq "${1:-3}"); do
      rm -rf "$work/ckpt"
      setsid "$PY" "$SRC/$script" "${small[@]}" --ckpt-dir "$work/ckpt" >"$work/log" 2>&1 &
      run=$!
      if [ "$moment" = "a save" ]; then
        for _ in $(seq 6000); do
          [ -n "$(find "$work/ckpt" -name '*.tmp' -size +1M 2>/dev/null)" ] && break
          sleep 0.01
        done
      else
        for _ in $(seq 1200); do grep -qE "$moment" "$work/log" && break; sleep 0.1; done
      fi
      kill -INT -- -"$run"
      sent=$EPOCHREALTIME
      # a run that does not stop is killed after 90 s, and counts as failed
      (sleep 90 && kill -KILL -- -"$run") 2>/dev/null &
      watchdog=$!
      wait "$run"
      status=$?
      took=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $sent }")
      pkill -P "$watchdog"
      # multiprocessing's resource tracker ends just after the run; a zombie has ended
      sleep 2
      left=$(ps -o stat= -g "$run" | grep -vc Z)
      tmp=$(find "$work/ckpt" -name '*.tmp' | wc -l)
      tracebacks=$(grep -c Traceback "$work/log")
      echo "$SRC/$script, Ctrl-C at '$moment' ($i): exit $status (130 expected) after $took s," \
        "$left processes left, $tmp .tmp, $tracebacks tracebacks"
      if [ "$status$left$tmp$tracebacks" != 130000 ]; then
        failed=$((failed + 1))
        grep -v "^epoch .* step" "$work/log" | tail -30
      fi
    done
  done
done
echo "gpu_ctrl_c: $failed failed"
[ "$failed" -eq 0 ]
