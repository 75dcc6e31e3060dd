"""Score saved SeqNet weights with ddp_fashionmnist.py's own test(), at any world size.

    torchrun --standalone --nproc-per-node=3 tests/score_fashionmnist.py WEIGHTS OUT.json [flags]

The flags are ddp_fashionmnist.py's (--cpu, --synthetic, --data ...). Rank 0 writes
{"correct", "seen"}. The tests use it to check that evaluation counts each image exactly once
at any world size; the script itself has no evaluation-only mode."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_fashionmnist as script  # noqa: E402

weights, out = sys.argv.pop(1), sys.argv.pop(1)
args = script.parse_args()
device = script.ddp_setup(int(os.environ["LOCAL_RANK"]), args)
_, test_set = script.load_datasets(args)
model = script.SeqNet(784, 200, 200, 10).to(device)
model.load_state_dict(torch.load(weights, map_location=device, weights_only=True))
correct, seen = script.test(model, test_set, device, args.batch_size)
if torch.distributed.get_rank() == 0:
    Path(out).write_text(json.dumps({"correct": correct, "seen": seen}))
script.cleanup()
