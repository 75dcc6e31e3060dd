"""A user's own model and data: copy ddp_resnet.py, replace exactly build_model and
load_datasets (a small CNN, an in-memory TensorDataset with a validation split), and the copy
launches, trains, validates each image once, saves and resumes as the original does."""

import difflib
import sys

import torch

from conftest import ROOT, metrics, run

OWN = '''def load_datasets(args: argparse.Namespace) -> tuple:
    """The training and validation sets (None without --val-data), and the number of classes."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(70, 3, 16, 16, generator=g)
    labels = (images.mean(dim=(1, 2, 3)) > 0).long()  # bright or dark: learnable
    data = TensorDataset(images, labels)
    return Subset(data, range(60)), Subset(data, range(60, 70)), 2


def build_model(args: argparse.Namespace, num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes),
    )
'''


def own_copy(folder):
    text = (ROOT / "ddp_resnet.py").read_text()
    start, end = (
        text.index("def load_datasets"),
        text.index("\n\n\n", text.index("def build_model")),
    )
    copy = text[:start] + OWN.rstrip("\n") + text[end:]
    (folder / "my_training.py").write_text(copy)
    diff = [
        d
        for d in difflib.unified_diff(text.splitlines(), copy.splitlines(), lineterm="", n=0)
        if d[:1] in "+-" and not d.startswith(("+++", "---"))
    ]
    return folder / "my_training.py", diff


def test_own_model_and_data_in_two_functions(tmp_path):
    script, diff = own_copy(tmp_path)
    print(
        f"the swap changes {len(diff)} lines: {sum(d[0] == '-' for d in diff)} out, {sum(d[0] == '+' for d in diff)} in"
    )
    ckpt, flags = tmp_path / "ckpt", ["--cpu", "--nprocs", 2, "--batch-size", 5, "--timeout", 60]
    cmd = [sys.executable, script, *flags, "--ckpt-dir", ckpt, "--metrics-out", tmp_path / "m.json"]
    res = run([str(c) for c in [*cmd, "--epochs", 2]], timeout=120)
    m = metrics(tmp_path / "m.json")
    assert (m["model"], m["epochs_run"], m["steps"], m["val_samples"]) == ("Sequential", 2, 6, 10)
    assert m["script"] == "my_training.py"  # the copy's own name, in the start line too
    assert res.stdout.splitlines()[0].startswith("start | script my_training.py | world_size 2 |")
    assert "| model Sequential | steps 6 | epochs 1-2" in res.stdout.splitlines()[0]
    res = run([str(c) for c in [*cmd, "--epochs", 3, "--resume"]], timeout=120)
    m = metrics(tmp_path / "m.json")
    assert (m["epochs_run"], m["val_samples"]) == (1, 10) and m["checkpoint"] == str(
        ckpt / "epoch_3.pt"
    )
    assert res.stdout.splitlines()[0].endswith(
        f"| resuming from {ckpt / 'epoch_2.pt'} | epochs 3-3"
    )
    ckpt = torch.load(ckpt / "epoch_3.pt", weights_only=True)
    assert (
        ckpt["epoch"] == 3 and "0.weight" in ckpt["model_state_dict"]
    )  # a plain Sequential's keys
