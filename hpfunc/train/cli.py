"""``hpfunc train CONFIG.yaml [--set key.path=value ...] [--out DIR] [--steps N] [--overwrite] [--resume auto|never|PATH] [--check]``.

A config whose ``parallel.mesh`` needs more than one process is checked here, its output folder
claimed (:class:`hpfunc.train.output.RunFolder`: the lock is held here for the whole launch and its
token handed to rank 0 in ``HPFUNC_TRAIN_OUTPUT_LOCK``), then the same command runs on that many
ranks under ``torch.distributed.run`` (:mod:`hpfunc.train.launch`); inside a rank (``RANK`` /
``WORLD_SIZE`` set) it trains. Exit status: 0 after a run, 2 for a usage or config error (the message
names the key; the output folder's and the data's errors are config errors too), 1 otherwise: a
diverged run, a failed write (a full disk), or for a multi-process run the status of the first rank
that failed.

Example:
    >>> main(["--help"])  # doctest: +ELLIPSIS
    usage: hpfunc train CONFIG.yaml ...
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main", "USAGE", "LOCK_ENV"]

# How the launching process hands its claim on the output folder to rank 0 (the token of its lock).
LOCK_ENV = "HPFUNC_TRAIN_OUTPUT_LOCK"

USAGE = """usage: hpfunc train CONFIG.yaml [--set key.path=value ...] [--out DIR] [--steps N] [--overwrite]
                    [--resume auto|never|PATH] [--check]

Train a model from a YAML config and write config.yaml, metrics.jsonl, loss.png, sample.txt and
summary.json into the output folder, which the run owns (locked) while it runs. A `parallel:` mesh of
N > 1 processes starts N ranks (torch.distributed.run; gloo, or NCCL with parallel.device cuda)
running this same command.

  CONFIG.yaml             the run's config (see docs/train.md; examples in examples/configs/)
  --set key.path=value    override one config key, e.g. --set train.steps=50 --set optimizer.lr=1e-3
                          (repeatable; values are YAML: 3, 0.1, null, [0.9, 0.95])
  --out DIR               output folder (same as --set output.dir=DIR)
  --steps N               number of steps (same as --set train.steps=N)
  --overwrite             replace the run already in the output folder (without it such a folder is
                          refused); the old files go when the new run starts writing
  --resume auto|never|PATH
                          continue from a checkpoint (checkpoint: section): auto = the newest complete
                          one of the run's checkpoint.dir (none: start at step 0), PATH = a checkpoint
                          folder or a folder of them, never = start at step 0 (the default); the run
                          continues in its output folder, metrics.jsonl cut back to the checkpoint's step
  --check                 check the config, the parallel plan against the model and the data (read
                          and checked against the model and the batch), and print the config
                          resolved, with the data and the plan per parameter, without training
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpfunc train", usage=USAGE, add_help=False)
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out")
    p.add_argument("--steps")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--resume", default="never")
    p.add_argument("--check", action="store_true")
    return p


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit; keep control of the message
        raise _UsageError(message)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``hpfunc train``; raises ``SystemExit`` with a non-zero status on errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    if not argv:  # a usage error, as argparse's: the usage on stderr, status 2
        print(f"hpfunc train: error: the config file is required\n\n{USAGE}", file=sys.stderr, end="")
        raise SystemExit(2)
    parser = _Parser(prog="hpfunc train", usage=USAGE, add_help=False)
    for action in _parser()._actions:
        parser._add_action(action)
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(f"hpfunc train: {e}\n\n{USAGE}", file=sys.stderr, end="")
        raise SystemExit(2) from None

    import yaml

    from hpfunc.train.build import check_buildable
    from hpfunc.train.config import ConfigError, config_to_dict, load_config
    from hpfunc.train.launch import in_launched_rank, launch, rank_of_this_process

    overrides = list(args.overrides)
    if args.out is not None and not args.out.strip():
        print(f"hpfunc train: --out: expected a folder path, found {args.out!r} (an empty path would write into the "
              f"current folder; give --out . for that)", file=sys.stderr)
        raise SystemExit(2)
    if args.out is not None:
        overrides.append(f"output.dir={args.out}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    in_rank = in_launched_rank()
    who = f"hpfunc train [rank {rank_of_this_process()}]" if in_rank else "hpfunc train"
    try:
        cfg = load_config(args.config, overrides)
        model_cfg = check_buildable(cfg)
        from hpfunc.train.device import backend_for, resolve_device

        device = resolve_device(cfg.parallel)  # parallel.device: cuda on a machine without one fails here
        if args.check:
            from hpfunc.train.data import check_data, load_data

            from hpfunc.train.build import model_spec

            spec = model_spec(cfg.model)
            data = load_data(cfg.data)
            check_data(data, cfg, spec.vocab_size(model_cfg))
            print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
            # YAML comments: the output still loads as the resolved config
            print(f"# data: {data.description} ({data.train.numel():,} train / {data.val.numel():,} val), "
                  f"token ids < {data.vocab_size} (model.{spec.vocab_field} {spec.vocab_size(model_cfg)}), windows of "
                  f"train.seq_len + 1 = {cfg.train.seq_len + 1}")
            if cfg.parallel.plan:
                from hpfunc.train.distributed import describe_plan

                print("\n".join("# " + line for line in describe_plan(cfg, model_cfg).splitlines()))
            return
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if in_rank and world != cfg.parallel.size:
            # e.g. a single-process config under a 4-process torchrun: 4 copies would write one folder
            raise ConfigError(f"parallel.mesh: this launch has {world} processes (WORLD_SIZE) but the config's mesh "
                              f"{cfg.parallel.mesh_text} needs {cfg.parallel.size}; run "
                              f"`hpfunc train` without a launcher (it starts the processes) or match the mesh")
        inputs = [("config", args.config)]
        if not args.resume:
            raise ConfigError("--resume: expected auto, never or the path of a checkpoint, found ''")
        if cfg.parallel.max_restarts and cfg.parallel.size <= 1:
            raise ConfigError(f"parallel.max_restarts: {cfg.parallel.max_restarts} restarts need a mesh of several "
                              f"processes (torch's elastic launcher restarts the ranks); a one-process run is "
                              f"continued with --resume auto")
        if cfg.parallel.size > 1 and not in_rank:
            from hpfunc.checkpoint import latest
            from hpfunc.train.checkpointing import checkpoint_root, plan_resume
            from hpfunc.train.data import data_inputs
            from hpfunc.train.output import RunFolder

            from hpfunc.train.data import check_data_files

            check_data_files(cfg.data)  # found missing here once, not by every rank after they start
            # where the run starts is checked here too (the saved config against this one), before any rank
            plan = plan_resume(cfg, cfg.output.dir, args.resume, overwrite=args.overwrite)
            for line in plan.skipped:  # damaged newer checkpoints, renamed here (the ranks see them no more)
                print(f"hpfunc train: {line}", file=sys.stderr, flush=True)
            hint = ("; or continue it from its newest checkpoint with --resume auto"
                    if latest(checkpoint_root(cfg, cfg.output.dir)) is not None else "")
            # the output folder is checked and claimed here, before any rank starts, and held to the end
            with RunFolder(cfg.output.dir, overwrite=args.overwrite, inputs=[*inputs, *data_inputs(cfg.data)],
                           resume=plan.resume, hint=hint) as folder:
                if cfg.output.progress != "none":
                    # the ranks take a while to start (each imports torch): say what is happening
                    print(f"hpfunc train: starting {cfg.parallel.size} processes (torch.distributed.run, "
                          f"{backend_for(device)}) for the mesh {cfg.parallel.mesh_text}", flush=True)
                before = os.environ.get(LOCK_ENV)
                os.environ[LOCK_ENV] = folder.token or ""  # the ranks inherit the environment
                try:
                    status = launch(["hpfunc.cli", "train", *argv], cfg.parallel.size, module=True,
                                    threads=cfg.train.num_threads, timeout_s=cfg.parallel.timeout_s,
                                    max_restarts=cfg.parallel.max_restarts,
                                    shutdown_timeout_s=cfg.checkpoint.last_words_timeout_s + 10,
                                    backend=backend_for(device))
                finally:
                    if before is None:
                        os.environ.pop(LOCK_ENV, None)
                    else:
                        os.environ[LOCK_ENV] = before
            if status:
                raise SystemExit(status)
            return
        from hpfunc.checkpoint import CheckpointError
        from hpfunc.train.loop import Stopped, TrainingDiverged
        from hpfunc.train.trainer import run
        from hpfunc.train.output import OutputWriteError

        try:
            run(cfg, overwrite=args.overwrite, inputs=inputs,
                lock_token=os.environ.get(LOCK_ENV) if in_rank else None, resume=args.resume)
        except Stopped as e:
            if rank_of_this_process() == 0:
                print(f"{who}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(128 + e.signum) from None
        except TrainingDiverged as e:
            print(f"{who}: training diverged at {e}", file=sys.stderr)
            raise SystemExit(1) from None
        except OutputWriteError as e:
            print(f"{who}: output error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except CheckpointError as e:
            # the same error on every rank (a save's failure is agreed on): one line, from rank 0
            if rank_of_this_process() == 0:
                print(f"hpfunc train: checkpoint error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    except ConfigError as e:
        print(f"{who}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"{who}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if not in_rank:
            raise
        # the launcher reports only an exit status: say here which rank failed and why
        import traceback

        traceback.print_exc()
        print(f"{who}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
