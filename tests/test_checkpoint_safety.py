"""A checkpoint is data, never code. A `.ckpt` shared by a colleague or downloaded from W&B whose
pickle carries a payload (an object whose unpickling runs a shell command), names a class of
another program, or holds a whole pickled module is refused in one `error:` line with exit 2 by
every command that reads one (fit resume, validate, test, analyze), and the payload never runs.
The project's own checkpoints load as data (`weights_only=True`)."""

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import REPO, SMALL, run

from fl_lightning.checkpointing import AtomicCheckpointIO, UnsafeCheckpointError, read_checkpoint


class ShellPayload:
    """Unpickled without weights_only, this runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Foreign:
    """A class of another program: its module is importable here, yet it is not data."""


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety") / "run"
    assert run(["fit", *SMALL, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(root)]) == 0
    return root


def bad_checkpoint(kind: str, real: Path, marker: Path) -> bytes:
    """The run's own checkpoint with one bad object inside, or a foreign file."""
    state = read_checkpoint(real)
    if kind == "payload":
        state["hyper_parameters"]["note"] = ShellPayload(marker)
    elif kind == "unknown_global":
        state["hyper_parameters"]["args"] = argparse.Namespace(lr=0.1)
    elif kind == "class_of_another_program":
        state["callbacks"]["extra"] = Foreign()
    else:  # a plain torch.save of a module, the way many programs save models
        state = torch.nn.Linear(2, 2)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


KINDS = ["payload", "unknown_global", "class_of_another_program", "module"]
REFUSED_OBJECT = {"payload": "posix.system", "unknown_global": "argparse.Namespace",
                  "class_of_another_program": "test_checkpoint_safety.Foreign",
                  "module": "torch.nn.modules.linear.Linear"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["fit", "validate", "test", "analyze"])
def test_a_checkpoint_that_is_not_data_is_refused_before_anything_in_it_runs(fitted, tmp_path, capsys, kind,
                                                                           command):
    marker = tmp_path / "MARKER"
    data = bad_checkpoint(kind, fitted / "checkpoints" / "last.ckpt", marker)
    if command == "fit":  # a resume: the file placed as the run's own last.ckpt
        run_dir = tmp_path / "run"
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(data)
        (run_dir / "config.yaml").write_bytes((fitted / "config.yaml").read_bytes())
        args = ["fit", *SMALL, "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(run_dir),
                "--ckpt_path", "last"]
    else:
        ckpt = tmp_path / "shared.ckpt"
        ckpt.write_bytes(data)
        args = [command, "--config", str(fitted / "config.yaml"), "--ckpt_path", str(ckpt)]
    capsys.readouterr()
    assert run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --ckpt_path "), err
    assert f"refused: the file holds a Python object ({REFUSED_OBJECT[kind]}), not data" in err[0], err
    assert not marker.exists(), "the payload ran"


def test_fit_resume_of_a_payload_checkpoint_in_a_fresh_process(fitted, tmp_path):
    """As a user meets it: a new process, the file as the run's own last.ckpt."""
    marker = tmp_path / "MARKER"
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(bad_checkpoint("payload", fitted / "checkpoints" /
                                                                        "last.ckpt", marker))
    (run_dir / "config.yaml").write_bytes((fitted / "config.yaml").read_bytes())
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO / "tests"))
    done = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "fit", *SMALL, "--trainer.max_epochs", "2",
                           "--trainer.default_root_dir", str(run_dir), "--ckpt_path", "last"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr, done.stderr
    assert "(posix.system), not data" in done.stderr
    assert not marker.exists(), "the payload ran"


def test_lightnings_own_load_is_data_only_whatever_it_is_asked(fitted, tmp_path):
    """The checkpoint IO Lightning loads through (fit, validate, test) never unpickles code, even
    when asked for weights_only=False."""
    marker = tmp_path / "MARKER"
    path = tmp_path / "payload.ckpt"
    path.write_bytes(bad_checkpoint("payload", fitted / "checkpoints" / "last.ckpt", marker))
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    assert not marker.exists()
    own = AtomicCheckpointIO().load_checkpoint(fitted / "checkpoints" / "last.ckpt", weights_only=False)
    assert own["fl_format"] == 3 and own["state_dict"]


def test_the_projects_own_checkpoint_is_data(fitted):
    state = torch.load(fitted / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert {"state_dict", "hyper_parameters", "loops", "callbacks"} <= set(state)


def test_every_project_type_a_checkpoint_may_hold_is_allowlisted_by_its_own_module():
    """A researcher's `torch.load(ckpt, weights_only=True)` needs only the type's import."""
    import subprocess
    import sys

    code = ("import torch, fl_lightning.data.datasets as d\n"
            "print(d.DataSpec in torch.serialization.get_safe_globals())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr
    from fl_lightning.checkpointing import SAFE_GLOBALS
    assert set(SAFE_GLOBALS) <= set(torch.serialization.get_safe_globals())
