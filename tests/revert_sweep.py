"""Put each tutorial line back, one at a time, in a scratch copy of the committed scripts, and
run the tests that should catch it. One Markdown row per revert: the tests that failed, which
must never be none (the README's table of fixes comes from it). About 15 minutes on 2 cores.

    python tests/revert_sweep.py [NAME-PART ...]   # all reverts, or those whose name has a part
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HEAD = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable
R = [  # (name, script, [(the line as it is, the tutorial's), ...], the tests that catch it)
    (
        "gather: `[1, 2, 3] + rank`",
        "ddp_gather.py",
        [("[x + rank for x in [1, 2, 3]]", "[1, 2, 3] + rank")],
        "tests/test_gather.py::test_all_gather_object_rank_order",
    ),
    (
        "gather: nccl on CPU",
        "ddp_gather.py",
        [('"nccl" if cuda else "gloo",', '"nccl",')],
        "tests/test_gather.py::test_all_gather_object_rank_order",
    ),
    (
        "gather: port 12355",
        "ddp_gather.py",
        [
            (
                'os.environ["MASTER_PORT"] = str(sock.getsockname()[1])',
                'os.environ["MASTER_PORT"] = "12355"',
            )
        ],
        "tests/test_gather.py::test_all_gather_object_rank_order",
    ),
    (
        "gather: the free port probed, not held",
        "ddp_gather.py",
        [
            (
                'os.environ["MASTER_PORT"] = str(sock.getsockname()[1])\n',
                'os.environ["MASTER_PORT"] = str(sock.getsockname()[1])\n    sock.close()\n',
            )
        ],
        "tests/test_gather.py::test_no_other_program_takes_the_port_while_the_ranks_meet",
    ),
    (  # the line above `import torch`, and the launcher's SIGTERM to each rank on Ctrl-C
        "gather: Ctrl-C while the ranks meet",
        "ddp_gather.py",
        [
            ("signal.signal(signal.SIGINT, signal.SIG_DFL)\n", ""),
            (
                "for sig in signal.SIGINT, signal.SIGTERM:\n        signal.signal(sig, terminate_ranks)",
                "signal.signal(signal.SIGTERM, terminate_ranks)",
            ),
        ],
        "tests/test_faults.py::test_ctrl_c_while_the_ranks_meet_ends_at_once",
    ),
    (
        "ddp: Ctrl-C while torch loads",
        "ddp_resnet.py",
        [("signal.signal(signal.SIGINT, signal.SIG_DFL)\n", "")],
        "tests/test_faults.py::test_ctrl_c_in_the_first_seconds_is_quiet[ddp_resnet.py]",
    ),
    (
        "fm: every rank all cores",
        "ddp_fashionmnist.py",
        [('os.environ["OMP_NUM_THREADS"] = str(threads)', "pass")],
        "tests/test_faults.py::test_killed_rank_ends_the_job_within_seconds",
    ),
    (
        "fm: import mlflow",
        "ddp_fashionmnist.py",
        [("import argparse\n", "import argparse\nimport mlflow\n")],
        "tests/test_fashionmnist.py::test_each_test_image_once_and_the_loss_per_image",
    ),
    (
        "fm: second / 255",
        "ddp_fashionmnist.py",
        [
            (
                "images, labels = images.to(device), labels.to(device)",
                "images, labels = torch.div(images, 255.0).to(device), labels.to(device)",
            )
        ],
        "tests/test_fixes.py::test_fashionmnist_downloaded_once_per_machine_then_learned",
    ),
    (
        "fm: pin_memory=True",
        "ddp_fashionmnist.py",
        [('pin = device.type == "cuda"', "pin = True")],
        "tests/test_fashionmnist.py::test_each_test_image_once_and_the_loss_per_image",
    ),
    (
        "fm: no set_epoch",
        "ddp_fashionmnist.py",
        [("        train_loader.sampler.set_epoch(epoch)", "        pass")],
        "tests/test_fixes.py::test_each_epoch_a_new_order_each_rank_its_own_share_the_loss_of_all",
    ),
    (
        "fm: rank 0's loss",
        "ddp_fashionmnist.py",
        [
            (
                "        dist.all_reduce(running_loss)",
                "        running_loss *= dist.get_world_size()",
            )
        ],
        "tests/test_fixes.py::test_each_epoch_a_new_order_each_rank_its_own_share_the_loss_of_all",
    ),
    (
        "fm: every rank downloads",
        "ddp_fashionmnist.py",
        [("if local_rank > 0:", "if False:"), ("if local_rank == 0:", "if False:")],
        "tests/test_fixes.py::test_fashionmnist_downloaded_once_per_machine_then_learned",
    ),
    (
        "fm: DistributedSampler for test()",
        "ddp_fashionmnist.py",
        [
            (
                "DataLoader(share, batch_size)",
                "DataLoader(test_set, batch_size, sampler=DistributedSampler(test_set))",
            )
        ],
        "tests/test_multinode.py::test_processes_with_rank_but_no_local_rank_join_as_that_rank",
    ),
    (
        "ddp: drop_last=False",
        "ddp_resnet.py",
        [("drop_last=True,", "drop_last=False,")],
        "tests/test_faults.py::test_dataset_not_divisible_by_world_size",
    ),
    (
        "ddp: no set_epoch",
        "ddp_resnet.py",
        [("    dataloader.sampler.set_epoch(epoch)", "    pass")],
        "tests/test_fixes.py::test_each_epoch_a_new_order_each_rank_its_own_share_the_loss_of_all",
    ),
    (
        "ddp: rank 0's loss",
        "ddp_resnet.py",
        [("    dist.all_reduce(loss_sum)", "    loss_sum *= dist.get_world_size()")],
        "tests/test_fixes.py::test_each_epoch_a_new_order_each_rank_its_own_share_the_loss_of_all",
    ),
    (
        "ddp: 4 * GPUs workers",
        "ddp_resnet.py",
        [
            (
                "        num_workers=args.workers,\n",
                "        num_workers=4 * torch.cuda.device_count(),\n",
            )
        ],
        "tests/test_fixes.py::test_each_epoch_a_new_order_each_rank_its_own_share_the_loss_of_all",
    ),
    (
        "ddp: range(1, epochs)",
        "ddp_resnet.py",
        [("range(first_epoch, args.epochs + 1)", "range(first_epoch, args.epochs)")],
        "tests/test_resnet.py::test_ddp_run_prints_saves_and_reports",
    ),
    (
        "ddp: LOCAL_RANK 0 writes",
        "ddp_resnet.py",
        [
            (
                "        if dist.get_rank() == 0:\n            path = save_model",
                '        if os.environ.get("LOCAL_RANK", "0") == "0":\n            path = save_model',
            )
        ],
        "tests/test_multinode.py::test_only_global_rank_0_writes_checkpoints",
    ),
    (
        "ddp: file.touch()",
        "ddp_resnet.py",
        [('tmp = Path(f"{file}.tmp")', 'tmp = Path(f"{file}.tmp")\n    file.touch()')],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume",
    ),
    (
        "ddp: no barrier before the load",
        "ddp_resnet.py",
        [("    dist.barrier()\n", "    pass\n")],
        "tests/test_resnet.py::test_ddp_run_prints_saves_and_reports tests/test_resnet.py::test_lr_on_resume_is_the_flags",
    ),
    (
        "ddp: workers import torch each epoch",
        "ddp_resnet.py",
        [
            (
                '    mp.set_forkserver_preload([Path(__file__).stem, "torch", "torchvision"])\n',
                "",
            )
        ],
        "tests/test_resnet.py::test_loader_workers_come_from_a_forkserver_and_ignore_ctrl_c[ddp_resnet.py]",
    ),
    (
        "ddp: workers die on Ctrl-C",
        "ddp_resnet.py",
        [("            worker_init_fn=worker_init,\n", "")],
        "tests/test_resnet.py::test_loader_workers_come_from_a_forkserver_and_ignore_ctrl_c[ddp_resnet.py]",
    ),
    (
        "dp: workers die on Ctrl-C",
        "dp_resnet.py",
        [("            worker_init_fn=worker_init,\n", "")],
        "tests/test_resnet.py::test_loader_workers_come_from_a_forkserver_and_ignore_ctrl_c[dp_resnet.py]",
    ),
    (
        "ddp: Ctrl-C mid-save a RuntimeError",
        "ddp_resnet.py",
        [("            raise e.__context__ from None\n", "            pass\n")],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume",
    ),
    (
        "dp: Ctrl-C mid-save a RuntimeError",
        "dp_resnet.py",
        [("            raise e.__context__ from None\n", "            pass\n")],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume[dp]",
    ),
    (
        "ddp: a second Ctrl-C raises again",
        "ddp_resnet.py",
        [("        signal.signal(sig, lambda signum, frame: None)\n", "        pass\n")],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume",
    ),
    (  # KeyboardInterrupt, as before: under torchrun, each rank's traceback
        "ddp: Ctrl-C raises KeyboardInterrupt in a rank",
        "ddp_resnet.py",
        [
            ("    sys.exit(130)\n", "    raise KeyboardInterrupt\n"),
            (
                "        sys.exit(e.exit_code)\n",
                "        sys.exit(e.exit_code)\n    except KeyboardInterrupt:\n        sys.exit(130)\n",
            ),
        ],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume[torchrun]",
    ),
    (  # the workers, the forkserver and the resource tracker outlive the killed process
        "ddp: loader workers outlive a killed rank",
        "ddp_resnet.py",
        [("    threading.Thread(target=exit_after_parent, daemon=True).start()\n", "")],
        "tests/test_faults.py::test_a_killed_training_process_leaves_no_loader_workers[spawn]",
    ),
    (  # both ranks train on, saving checkpoints, after torchrun is gone
        "ddp: ranks outlive a killed torchrun",
        "ddp_resnet.py",
        [("    threading.Thread(target=stop_after_launcher, daemon=True).start()\n", "")],
        "tests/test_faults.py::test_a_killed_training_process_leaves_no_loader_workers[torchrun_itself]",
    ),
    (  # the ranks meet on their own and train every epoch after their launcher is gone
        "fm: ranks outlive a launcher killed as they start",
        "ddp_fashionmnist.py",
        [("    threading.Thread(target=stop_after_launcher, daemon=True).start()\n", "")],
        "tests/test_faults.py::test_ranks_end_with_a_launcher_killed_as_they_start",
    ),
    (  # spawned ranks that read LAUNCHER after their launcher died take init for it
        "fm: spawned ranks watch the parent they found, not their launcher",
        "ddp_fashionmnist.py",
        [
            (
                "    launcher = parent.pid if parent else LAUNCHER\n",
                "    launcher = LAUNCHER\n",
            )
        ],
        "tests/test_faults.py::test_ranks_end_with_a_launcher_killed_as_they_start[spawn]",
    ),
    (
        "dp: loader workers outlive a killed process",
        "dp_resnet.py",
        [("    threading.Thread(target=exit_after_parent, daemon=True).start()\n", "")],
        "tests/test_faults.py::test_a_killed_training_process_leaves_no_loader_workers[dp]",
    ),
    (
        "dp: a second Ctrl-C raises again",
        "dp_resnet.py",
        [("        signal.signal(sig, lambda signum, frame: None)\n", "        pass\n")],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume[dp]",
    ),
    (
        "dp: a cut batch handover prints",
        "dp_resnet.py",
        [("    sys.excepthook = lambda *exc_info: None\n", "")],
        "tests/test_own_model.py::test_ctrl_c_while_a_worker_hands_a_batch_over_is_quiet",
    ),
    (
        "fm: --lr inf trains to nan",
        "ddp_fashionmnist.py",
        [('"--lr", type=learning_rate', '"--lr", type=float')],
        "tests/test_fashionmnist.py::test_bad_data_fails_before_training_and_names_the_cause",
    ),
    (
        "ddp: --lr nan trains to nan",
        "ddp_resnet.py",
        [('"--lr", type=learning_rate', '"--lr", type=float')],
        "tests/test_resnet.py::test_bad_input_fails_before_training_and_names_the_cause[ddp_resnet.py]",
    ),
    (  # torchrun then fails reading the empty file (JSONDecodeError), and restarts nothing
        "ddp: a stop cuts a failed rank's error file",
        "ddp_resnet.py",
        [
            (  # ignore_stops() after a return only, as before
                "    try:\n        fn(local_rank, args)\n    finally:\n",
                "    fn(local_rank, args)\n    if True:\n",
            )
        ],
        "tests/test_faults.py::test_exception_in_one_rank_ends_the_job[torchrun]",
    ),
    (
        "dp: a stopped worker holds the exit",
        "dp_resnet.py",
        [("            util.Finalize(None, continue_workers, exitpriority=0)\n", "")],
        "tests/test_own_model.py::test_a_stopped_loader_worker_does_not_hold_the_exit[dp_resnet.py]",
    ),
    (
        "ddp: a stopped worker holds the exit",
        "ddp_resnet.py",
        [("            util.Finalize(None, continue_workers, exitpriority=0)\n", "")],
        "tests/test_own_model.py::test_a_stopped_loader_worker_does_not_hold_the_exit[ddp_resnet.py]",
    ),
    (  # a stop inside iter(): a half-built loader's AttributeError, its workers' FileNotFoundError
        "ddp: a stop as the workers start is not held",
        "ddp_resnet.py",
        [("    def __iter__(self):\n", "    def iter_held(self):\n")],
        "tests/test_faults.py::test_ctrl_c_as_the_loader_workers_start_is_quiet_and_leaves_nothing[ddp_resnet.py]",
    ),
    (  # the launcher's SIGTERM after a Ctrl-C: "Exception ignored" in the iterator's __del__
        "ddp: a next stop raises as a held stop ends the workers",
        "ddp_resnet.py",
        [("        ignore_stops()\n        del batches\n", "        del batches\n")],
        "tests/test_faults.py::test_ctrl_c_as_the_loader_workers_start_is_quiet_and_leaves_nothing[ddp_resnet.py]",
    ),
    (
        "dp: a next stop raises as a held stop ends the workers",
        "dp_resnet.py",
        [("        ignore_stops()\n        del batches\n", "        del batches\n")],
        "tests/test_faults.py::test_ctrl_c_as_the_loader_workers_start_is_quiet_and_leaves_nothing[dp_resnet.py]",
    ),
    (  # the epoch's last step breaks out of the loop, as --max-steps once did
        "dp: an epoch leaves its loader early",
        "dp_resnet.py",
        [
            (
                "            last_print = now\n",
                "            last_print = now\n        if step == steps:\n            break\n",
            )
        ],
        "tests/test_own_model.py::test_ctrl_c_while_an_epoch_ends_its_loader_workers_stops_the_run[dp_resnet.py]",
    ),
    (  # --max-steps as a break out of the loop, over the whole data
        "ddp: --max-steps leaves the loader early",
        "ddp_resnet.py",
        [
            ("    if args.max_steps:\n", "    if False:\n"),
            (
                "    steps = len(dataloader)\n",
                "    steps = min(len(dataloader), args.max_steps or 10**9)\n",
            ),
            (
                "            last_print = now\n",
                "            last_print = now\n        if step == args.max_steps:\n            break\n",
            ),
        ],
        "tests/test_own_model.py::test_ctrl_c_while_an_epoch_ends_its_loader_workers_stops_the_run[ddp_resnet.py]",
    ),
    (
        "dp: workers forked",
        "dp_resnet.py",
        [('            multiprocessing_context="forkserver" if num_workers else None,\n', "")],
        "tests/test_resnet.py::test_loader_workers_come_from_a_forkserver_and_ignore_ctrl_c[dp_resnet.py]",
    ),
    (  # from another folder the forkserver cannot find the script, and imports torch with
        # Python's own SIGINT handler: a Ctrl-C then prints its traceback
        "ddp: the forkserver starts in the caller's folder",
        "ddp_resnet.py",
        [("    os.chdir(Path(__file__).parent)\n", "")],
        "tests/test_faults.py::test_a_stop_while_the_forkserver_loads_torch_is_quiet[ddp_resnet.py-ctrl_c]",
    ),
    (  # from another folder the forkserver cannot find the script, and imports torch with
        # Python's own SIGINT handler: a Ctrl-C then prints its traceback
        "dp: the forkserver starts in the caller's folder",
        "dp_resnet.py",
        [("    os.chdir(Path(__file__).parent)\n", "")],
        "tests/test_faults.py::test_a_stop_while_the_forkserver_loads_torch_is_quiet[dp_resnet.py-ctrl_c]",
    ),
    (  # a Ctrl-C while the forkserver imports ends it too, and the loader's start, waiting
        # for it, fails (a traceback from multiprocessing's start)
        "ddp: a start that a stop failed raises",
        "ddp_resnet.py",
        [
            (
                "            if not held:\n                raise\n            batches = None\n",
                "            raise\n",
            )
        ],
        "tests/test_faults.py::test_a_stop_while_the_forkserver_loads_torch_is_quiet[ddp_resnet.py-ctrl_c]",
    ),
    (  # a Ctrl-C while the forkserver imports ends it too, and the loader's start, waiting
        # for it, fails (a traceback from multiprocessing's start)
        "dp: a start that a stop failed raises",
        "dp_resnet.py",
        [
            (
                "            if not held:\n                raise\n            batches = None\n",
                "            raise\n",
            )
        ],
        "tests/test_faults.py::test_a_stop_while_the_forkserver_loads_torch_is_quiet[dp_resnet.py-ctrl_c]",
    ),
    (
        "ddp: weights_only=False",
        "ddp_resnet.py",
        [("map_location=device, weights_only=True", "map_location=device, weights_only=False")],
        "tests/test_resnet.py::test_a_bad_checkpoint_on_resume_fails_before_training",
    ),
    (
        "ddp: pretrained=False",
        "ddp_resnet.py",
        [
            (
                "models.get_model(args.arch, weights=None, num_classes=num_classes)",
                "getattr(models, args.arch)(pretrained=False, num_classes=num_classes)",
            )
        ],
        "tests/test_resnet.py::test_ddp_run_prints_saves_and_reports",
    ),
    (
        "ddp: fresh run takes a used folder",
        "ddp_resnet.py",
        [("    if newest and not args.resume:", "    if False:")],
        "tests/test_resnet.py::test_a_fresh_run_refuses_a_folder_with_checkpoints",
    ),
    (
        "ddp: --lr from the checkpoint",
        "ddp_resnet.py",
        [('        group["lr"] = args.lr', "        pass")],
        "tests/test_resnet.py::test_lr_on_resume_is_the_flags",
    ),
    (
        "ddp: an unwritable --ckpt-dir trains",
        "ddp_resnet.py",
        [("        tempfile.TemporaryFile(dir=args.ckpt_dir).close()", "        pass")],
        "tests/test_resnet.py::test_bad_input_fails_before_training_and_names_the_cause",
    ),
    (
        "ddp: an empty val share skips",
        "ddp_resnet.py",
        [
            (
                "    correct = seen = 0",
                "    if not len(share):\n        return {}\n    correct = seen = 0",
            )
        ],
        "tests/test_validation.py::test_a_rank_with_no_validation_image_still_joins_the_count",
    ),
    (
        "ddp: each rank its own start",
        "ddp_resnet.py",
        [("    dist.broadcast(found, src=0)", "    pass")],
        "tests/test_multinode.py::test_rank_0_decides_where_every_rank_resumes",
    ),
    (
        "ddp: DistributedSampler for val",
        "ddp_resnet.py",
        [
            (
                "DataLoader(share, args.batch_size)",
                "DataLoader(val_set, args.batch_size, sampler=DistributedSampler(val_set))",
            )
        ],
        "tests/test_validation.py::test_each_image_scored_once_at_any_world_size",
    ),
    (
        "dp: shuffle=False",
        "dp_resnet.py",
        [("        shuffle=True,", "        shuffle=False,")],
        "tests/test_own_model.py::test_dataparallel_copy_resumes_to_the_bit_with_augmentation_and_dropout",
    ),
    (
        "dp: no reseed per epoch",
        "dp_resnet.py",
        [("    torch.manual_seed(epoch)", "    pass")],
        "tests/test_own_model.py::test_dataparallel_copy_resumes_to_the_bit_with_augmentation_and_dropout",
    ),
    (
        "dp: drop_last=False",
        "dp_resnet.py",
        [("drop_last=True", "drop_last=False")],
        "tests/test_faults.py::test_dataset_not_divisible_by_world_size",
    ),
    (
        "dp: range(1, epochs)",
        "dp_resnet.py",
        [("range(first_epoch, args.epochs + 1)", "range(first_epoch, args.epochs)")],
        "tests/test_resnet.py::test_a_fresh_run_refuses_a_folder_with_checkpoints",
    ),
    (
        "dp: file.touch()",
        "dp_resnet.py",
        [('tmp = Path(f"{file}.tmp")', 'tmp = Path(f"{file}.tmp")\n    file.touch()')],
        "tests/test_faults.py::test_a_stop_mid_epoch_then_ctrl_c_during_a_save_then_resume",
    ),
    (
        "dp: weights_only=False",
        "dp_resnet.py",
        [("weights_only=True", "weights_only=False")],
        "tests/test_resnet.py::test_a_bad_checkpoint_on_resume_fails_before_training",
    ),
    (
        "dp: pretrained=False",
        "dp_resnet.py",
        [
            (
                "models.get_model(args.arch, weights=None, num_classes=num_classes)",
                "getattr(models, args.arch)(pretrained=False, num_classes=num_classes)",
            )
        ],
        "tests/test_resnet.py::test_a_fresh_run_refuses_a_folder_with_checkpoints",
    ),
    (
        "dp: --lr from the checkpoint",
        "dp_resnet.py",
        [('        group["lr"] = args.lr', "        pass")],
        "tests/test_resnet.py::test_lr_on_resume_is_the_flags",
    ),
    (
        "dp: prints held back in a file",
        "dp_resnet.py",
        [("    sys.stdout.reconfigure(line_buffering=True)", "    pass")],
        "tests/test_resnet.py::test_dataparallel_lines_reach_a_log_file_as_they_are_printed",
    ),
    (  # rank 0 trains alone as a world of 1, saving checkpoints, until the others fail
        "gather: an exported WORLD_SIZE wins",
        "ddp_gather.py",
        [('    os.environ["WORLD_SIZE"] = str(args.nprocs)\n', "")],
        "tests/test_gather.py::test_all_gather_object_rank_order",
    ),
    (  # the checks look at the current folder, the saves go to /epoch_N.pt
        "ddp: an empty --ckpt-dir taken",
        "ddp_resnet.py",
        [('"--ckpt-dir", type=nonempty,', '"--ckpt-dir",')],
        "tests/test_resnet.py::test_bad_input_fails_before_training_and_names_the_cause",
    ),
    (
        "dp: an empty --data taken",
        "dp_resnet.py",
        [('"--data", type=nonempty,', '"--data",')],
        "tests/test_resnet.py::test_bad_input_fails_before_training_and_names_the_cause",
    ),
    (
        "ddp: any epoch_*.pt counts",
        "ddp_resnet.py",
        [('glob("epoch_[1-9]*.pt")', 'glob("epoch_*.pt")'), ("n.isdecimal()", "n.isdigit()")],
        "tests/test_resnet.py::test_lr_on_resume_is_the_flags",
    ),
    (  # the launcher's exit waits for the stopped rank without end
        "fm: a stopped rank never gets the launcher's SIGTERM",
        "ddp_fashionmnist.py",
        [("        os.kill(process.pid, signal.SIGCONT)\n", "")],
        "tests/test_faults.py::test_a_stop_reaches_a_stopped_rank",
    ),
    (  # Exception ignored in atexit callback ... SystemExit: 130
        "dp: a stop after the run lands in the exit hooks",
        "dp_resnet.py",
        [("and print a traceback\n    ignore_stops()\n", "and print a traceback\n")],
        "tests/test_faults.py::test_ctrl_c_as_the_run_ends_is_quiet",
    ),
]
if __name__ == "__main__":  # tests/test_size.py imports R
    only = sys.argv[1:]
    for name, script, replacements, tests in R:
        if only and not any(o in name for o in only):
            continue
        work = pathlib.Path(tempfile.mkdtemp(prefix="revert_"))
        subprocess.run(f"git -C {HEAD} archive HEAD | tar -x -C {work}", shell=True, check=True)
        text = (work / script).read_text()
        for old, new in replacements:
            assert text.count(old) >= 1, (name, old)
            text = text.replace(old, new)
        (work / script).write_text(text)
        res = subprocess.run(
            [PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests.split()],
            cwd=work,
            capture_output=True,
            text=True,
            env={**os.environ, "CI": "true"},
        )
        failed = re.findall(r"^FAILED (\S+)|^ERROR (\S+)", res.stdout, re.M)
        failed = [a or b for a, b in failed]
        summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-200:]
        shutil.rmtree(work, ignore_errors=True)
        names = ", ".join(f.split("::")[-1] for f in failed) or "NONE FAILED"
        print(f"| {name} | {names} | {summary} |", flush=True)
