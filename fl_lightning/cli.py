"""`fl-lightning`: the command.

    fl-lightning fit|validate|test|analyze ...   a run (LightningCLI, fl_lightning/lightning_cli.py)
    fl-lightning sweep <spec> ...                 many runs (fl_lightning/sweep/)
    fl-lightning report <dir> ...                 the table of the runs below a directory (fl_lightning/report.py)

This module only dispatches, so `fl-lightning --help` and `report` start without importing
Lightning (which takes seconds). Every subcommand reports a bad request in one `error:` line.
"""

from __future__ import annotations

import os
import sys

HELP = """usage: fl-lightning {fit,validate,test,analyze,sweep,report} ...

Federated-learning research methods (FedSOL, FedCONST, FedDr+, FedORGP and their baselines) on
PyTorch Lightning.

subcommands:
  fit        train a run: fl-lightning fit --config configs/fedsol_cifar10.yaml
  validate   evaluate a run's checkpoint on the global test set
  test       the same, as Lightning's test loop
  analyze    Hessian spectrum and loss surface of a checkpoint (--analysis.*)
  sweep      run a W&B sweep spec or a paper table's grid (online, or --local)
  report     the table (and curves) of the runs below a directory

Each subcommand has its own --help (e.g. fl-lightning fit --help; fl-lightning fit --model.help FedSOL).
"""
TOOLS = ("sweep", "report")
RUN_COMMANDS = ("fit", "validate", "test", "analyze")


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if not argv:
        print("error: no subcommand given; choose one of: fit, validate, test, analyze, sweep, report "
              "(fl-lightning --help)", file=sys.stderr)
        sys.exit(2)
    if argv[0] in ("-h", "--help"):
        print(HELP, end="")
        return
    if argv[0] == "_warm_worker":  # a local sweep's worker process (fl_lightning/warm.py), not for users
        from fl_lightning.warm import serve

        serve()
        return
    if not argv[0].startswith("-") and argv[0] not in (*RUN_COMMANDS, *TOOLS):
        # answered before Lightning is imported, which takes seconds
        print(f"error: unknown subcommand '{argv[0]}'{_did_you_mean(argv[0])}; choose one of: "
              f"{', '.join((*RUN_COMMANDS, *TOOLS))} (fl-lightning --help)", file=sys.stderr)
        sys.exit(2)
    if argv[0] in TOOLS:
        sys.exit(_run_tool(argv[0], argv[1:]))
    if os.environ.get("WANDB_SWEEP_ID"):  # launched by a W&B sweep agent: a directory per run
        from fl_lightning.sweep import agent_run_dir_args

        argv = agent_run_dir_args(argv)
        args = argv
    from fl_lightning.lightning_cli import main as run

    run(args)


def _did_you_mean(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name.lower(), (*RUN_COMMANDS, *TOOLS), n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def _run_tool(name: str, args: list[str]) -> int:
    from fl_lightning.errors import FLUserError

    if name == "sweep":
        from fl_lightning import sweep as tool
    else:
        from fl_lightning import report as tool
    try:
        return tool.main(args)
    except FLUserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fl-lightning report runs | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 0


if __name__ == "__main__":
    main()
