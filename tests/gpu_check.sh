#!/usr/bin/env bash
# The checks that need a GPU, in one run (about 5 minutes on one H100; not in the suite):
# run_all.sh and its bench on NCCL; ddp_resnet.py under torchrun with --amp --channels-last,
# saved, resumed, then resumed on the CPU on gloo; dp_resnet.py the same; FashionMNIST and the
# gather under torchrun; then tests/gpu_probe.py: one line for each GPU-only guard, and where
# an amp+channels-last step's time goes; last, tests/gpu_ctrl_c.sh: Ctrl-C with loader
# workers. Every command is shown with its exit code.
#
#   bash tests/gpu_check.sh 2>&1 | tee gpu_check.log
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
step() {  # step SECONDS CMD...: run CMD with a time limit, and say how it ended
  echo "=== ${*:2}"
  timeout --kill-after=10 "$1" "${@:2}"
  local status=$?
  echo "=== exit $status"
  [ "$status" -eq 0 ] || failed=$((failed + 1))
}
nvidia-smi -L
"$PY" -c 'import torch, torchvision as tv
print("torch", torch.__version__, "torchvision", tv.__version__, "cuda", torch.version.cuda,
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")'
step 300 bash run_all.sh
step 300 bash run_all.sh --bench
tr=("$PY" -m torch.distributed.run --standalone --nproc-per-node=1)
small=(--arch resnet18 --image-size 64 --batch-size 64 --max-steps 20 --amp --channels-last)
step 120 "${tr[@]}" ddp_resnet.py "${small[@]}" --epochs 1 --ckpt-dir "$work/ddp"
step 120 "${tr[@]}" ddp_resnet.py "${small[@]}" --epochs 2 --ckpt-dir "$work/ddp" --resume
cp "$work/ddp/epoch_2.pt" "$work/gpu_saved.pt"
step 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 ddp_resnet.py \
  "${small[@]}" --epochs 3 --ckpt-dir "$work/ddp" --resume --cpu
step 120 "$PY" dp_resnet.py "${small[@]}" --epochs 1 --ckpt-dir "$work/dp"
step 120 "$PY" dp_resnet.py "${small[@]}" --epochs 2 --ckpt-dir "$work/dp" --resume
fm=(--synthetic)
[ -s data/FashionMNIST/raw/t10k-labels-idx1-ubyte ] && fm=(--data data)
step 120 "${tr[@]}" ddp_fashionmnist.py --epochs 1 "${fm[@]}"
step 60 "${tr[@]}" ddp_gather.py
step 300 "$PY" tests/gpu_probe.py "$work/gpu_saved.pt"
step 300 bash tests/gpu_ctrl_c.sh 1
echo "gpu_check: $failed failed"
[ "$failed" -eq 0 ]
