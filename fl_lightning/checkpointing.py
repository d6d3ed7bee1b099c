"""Round checkpoints that survive what happens to long runs.

- `RoundCheckpoint` writes `<dir>/last.ckpt` after every completed round (after aggregation,
  validation and the round's metrics), and never in the middle of one: a checkpoint taken
  mid-round could not be resumed exactly, because the round's clients, uploads and the server's
  pending state are not in it.
- `AtomicCheckpointIO` writes every checkpoint to a temporary file in the same directory, fsyncs it
  and renames it over the old one, so a process killed at any moment leaves either the previous
  round's file or the new one, never a truncated one. (Lightning's own `_atomic_save` stages the
  file in TMPDIR and moves it: across filesystems that is a copy, which a kill can cut short.)
- `load_checkpoint_file`, `check_compatible` and `verify_client_state_files` read a checkpoint
  given as `--ckpt_path` before Lightning does, and turn an unreadable, foreign or older file, or a
  damaged client-state file it names, into one line.
- A checkpoint is data, never code: every read (ours and Lightning's, through `AtomicCheckpointIO`)
  unpickles with `weights_only=True`, which admits tensors, numbers, strings, plain containers and
  the few project types listed in `SAFE_GLOBALS`. A file carrying anything else (an object whose
  unpickling would call a function, a class of another program) is refused before any of it runs:
  checkpoints are shared between colleagues and downloaded from W&B.
- A run that a decision stopped in the middle of a round (divergence before the server step) has
  no new round to save: `RoundCheckpoint` records the outcome in the last completed round's file
  instead (`stamp_callback_state`), so a resume knows the run is over.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import pickle
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.client_store import ClientStateStore
from fl_lightning.config_files import flatten_options
from fl_lightning.data.datasets import DataSpec
from fl_lightning.errors import FLUserError

log = logging.getLogger(__name__)
LAST = "last.ckpt"
FORMAT = 3  # checkpoint["fl_format"]: 3 = server state in the state_dict, checked client-state files

# The project types a checkpoint may hold beside tensors, numbers, strings and plain containers: the
# method's hyperparameters carry the data's shape as a DataSpec. Each is allowlisted for torch's
# weights-only loader where it is defined, so that loading a checkpoint needs only its import.
SAFE_GLOBALS = (DataSpec,)


def read_checkpoint(path: str | Path, map_location: Any = "cpu") -> Any:
    """The object a checkpoint file holds, unpickled as data only (`weights_only=True`): a file
    whose pickle names any other global raises `UnsafeCheckpointError` and nothing in it runs."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        name = _forbidden_global(str(err))
        if name is None:
            raise
        raise UnsafeCheckpointError(name) from None


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's pickle asks for a Python object (`name`) that is not data."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _forbidden_global(message: str) -> str | None:
    """The global torch's weights-only unpickler refused, from its message (None: another error)."""
    if "Weights only load failed" not in message:
        return None
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", message)
    return found.group(1) if found else "unnamed"


def in_default_layout(value: Any) -> Any:
    """`value` (a checkpoint's nested dicts, lists and tuples) with every tensor in torch's default
    layout: a file must not depend on `--model.memory_format` (a channels-last weight would be
    saved with its strides), and loads into a model of either layout. Containers without a
    tensor in another layout are returned as they are."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, dict):
        items = {k: in_default_layout(v) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        out = copy.copy(value)  # the same kind of dict (OrderedDict, AttributeDict, ...)
        out.update(items)
        return out
    if type(value) in (list, tuple):
        items = [in_default_layout(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
    return value


class AtomicCheckpointIO(TorchCheckpointIO):
    """Atomic writes; a save requested mid-round (by anything but the round checkpoint) gets the
    last completed round's file, see `RoundCheckpoint`; and every load is data only, whatever
    `--weights_only` asked for (see `read_checkpoint`)."""

    def __init__(self, rounds: RoundCheckpoint | None = None):
        super().__init__()
        self.rounds = rounds

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        rounds = self.rounds
        if rounds is not None and rounds.mid_round and not rounds.saving:
            if not rounds.last_path.exists():
                rank_zero_info(f"checkpoint requested before the first round completed: not saved ({path})")
                return
            rank_zero_info(f"checkpoint requested mid-round: {path} gets the last completed round")
            data = rounds.last_path.read_bytes()
        else:
            buffer = io.BytesIO()
            torch.save(in_default_layout(checkpoint), buffer)
            data = buffer.getvalue()
        atomic_write_bytes(path, data)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return read_checkpoint(path, map_location)


class RoundCheckpoint(Checkpoint):
    """`last.ckpt` after every completed round.

    It runs at the end of the training epoch (= round), after the federated callback aggregated,
    validation evaluated the new global model and the round's metrics were computed; as a
    `Checkpoint` callback Lightning calls it after every other callback of that hook, so their
    per-round state (divergence counters, results rows) is in the file.

    Lightning may also save mid-round on its own (SLURM's auto-requeue signal saves an "hpc"
    checkpoint wherever training is). `AtomicCheckpointIO` gives such a save the content of the
    last completed round instead, so a requeued job resumes that round exactly rather than a
    half-trained one.
    """

    def __init__(self, dirpath: str | Path):
        super().__init__()
        self.dirpath = Path(dirpath)
        self.mid_round = False  # between a round's first client and its checkpoint
        self.saving = False
        self._saved_epoch = -1

    @property
    def last_path(self) -> Path:
        return self.dirpath / LAST

    @property
    def rounds_saved(self) -> int:
        return self._saved_epoch + 1

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        io_plugin = trainer.strategy.checkpoint_io
        if isinstance(io_plugin, AtomicCheckpointIO):
            io_plugin.rounds = self

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.mid_round = True

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        from fl_lightning.federation import federation_of

        federation = federation_of(trainer)
        if federation is not None and not federation.round_report.completed:
            # stopped before its server step: the last completed round's file learns the outcome
            if trainer.is_global_zero and self.last_path.exists():
                stamp_callback_state(self.last_path, federation.state_key, federation.state_dict())
            self.mid_round = False
            return
        # A resumed run replays the end-of-epoch hooks of the round it restored: saved already.
        if not trainer.sanity_checking and self._saved_epoch != trainer.current_epoch:
            self.saving = True
            started, previous = time.perf_counter(), self._saved_epoch
            try:
                self._saved_epoch = trainer.current_epoch  # recorded in the file being written
                trainer.save_checkpoint(self.last_path, weights_only=False)  # the whole run, loops included
            except BaseException:
                self._saved_epoch = previous  # not saved: a signal or a full disk cut the write short
                raise
            finally:
                self.saving = False
            if trainer.is_global_zero:  # benchmarks/checkpoint_cost.py reads this line
                log.debug("round %d checkpoint: %d bytes in %.4f s", trainer.current_epoch + 1,
                          self.last_path.stat().st_size, time.perf_counter() - started)
        self.mid_round = False

    def state_dict(self) -> dict[str, Any]:
        return {"saved_epoch": self._saved_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved_epoch = int(state_dict.get("saved_epoch", -1))


def stamp_callback_state(path: Path, state_key: str, state: dict) -> None:
    """Rewrites the checkpoint at `path` (atomically) with a callback's new state, nothing else."""
    checkpoint = read_checkpoint(path)
    checkpoint.setdefault("callbacks", {})[state_key] = state
    buffer = io.BytesIO()
    torch.save(in_default_layout(checkpoint), buffer)
    atomic_write_bytes(path, buffer.getvalue())


def completed_rounds(state: Mapping[str, Any]) -> int:
    """Rounds a checkpoint holds. (Its `epoch` is the index of the epoch it was saved in: a round
    checkpoint is saved at the epoch's end, before Lightning counts that epoch as completed.)"""
    return int(state["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])


# ---- checking a checkpoint before Lightning loads it ------------------------------------------

# Options that may differ between a run and its resumption: they change how a run is executed or
# reported, not what it computes.
RESUMABLE_DATA_OPTIONS = frozenset({"root", "download", "num_workers", "eval_batch_size"})
RESUMABLE_MODEL_OPTIONS = frozenset({"data_spec"})
INTERNAL = frozenset({"_instantiator", "_class_path"})


def load_checkpoint_file(path: str | Path) -> dict[str, Any]:
    """The checkpoint as a dict, or one line saying why this file is not one."""
    path = Path(path)
    if path.is_dir():
        raise FLUserError(f"--ckpt_path {path}: is a directory; give a .ckpt file such as {path / LAST}")
    size = path.stat().st_size
    if size == 0:
        raise FLUserError(f"--ckpt_path {path}: the file is empty (0 bytes); resume from another checkpoint or "
                          f"start a new run")
    try:
        state = read_checkpoint(path)
    except UnsafeCheckpointError as err:
        raise FLUserError(f"--ckpt_path {path}: refused: the file holds a Python object ({err.name}), not data; "
                          f"fl-lightning opens only checkpoints of tensors, numbers, strings and plain containers "
                          f"(nothing in the file was run)") from None
    except Exception as err:  # torch raises many types for damaged files (EOFError, RuntimeError, ...)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FLUserError(f"--ckpt_path {path}: not a readable checkpoint ({type(err).__name__}: {reason[:120]}); "
                          f"the file is truncated, corrupt or not a PyTorch checkpoint") from None
    if not isinstance(state, Mapping) or "state_dict" not in state or "hyper_parameters" not in state:
        raise FLUserError(f"--ckpt_path {path}: a PyTorch file, but not a Lightning checkpoint of an fl-lightning "
                          f"run (no state_dict/hyper_parameters)")
    if state.get("fl_format") != FORMAT:
        raise FLUserError(f"--ckpt_path {path}: written by an earlier fl-lightning (checkpoint format "
                          f"{state.get('fl_format', 'before 3')}, this version reads {FORMAT}); resume it with the "
                          f"version that wrote it, or start the run again")
    return dict(state)


def verify_client_state_files(path: str | Path, state: Mapping[str, Any]) -> None:
    """Every client-state file the checkpoint names is there, whole and the right client's (one
    line, exit 2, otherwise): checked before a run resumes, not rounds later when it is read."""
    saved = state.get("fl_client_states")
    if not saved:
        return
    store = ClientStateStore(Path(path).parent / "client_states")
    store.load_checkpoint_state(saved)
    store.verify()


def _plain(value: Any) -> Any:
    """Config values and checkpoint hyperparameters in one comparable form."""
    if isinstance(value, Mapping) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in dict(value.items()).items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _differences(kind: str, saved: Mapping, requested: Mapping, ignore: frozenset) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(requested)):
        if key in ignore or key in INTERNAL:
            continue
        if key in saved and key in requested and _plain(saved[key]) != _plain(requested[key]):
            out.append(f"{kind}.{key}: checkpoint {saved[key]!r}, requested {requested[key]!r}")
        elif (key in saved) != (key in requested):
            out.append(f"{kind}.{key}: only in the {'checkpoint' if key in saved else 'request'}")
    return out


def check_compatible(path: str | Path, state: Mapping[str, Any], model_cfg: Any, data_cfg: Mapping) -> None:
    """Refuse a checkpoint of another experiment: resuming it would silently continue a different
    method, architecture or data split under this run's name."""
    saved_model = dict(state.get("hyper_parameters") or {})
    saved_class = saved_model.get("_class_path") or state.get("hparams_name")
    requested_class = model_cfg.get("class_path") if hasattr(model_cfg, "get") else None
    if saved_class and requested_class and saved_class != requested_class:
        raise FLUserError(f"--ckpt_path {path}: checkpoint of method {saved_class.rsplit('.', 1)[-1]}, but the config "
                          f"asks for {requested_class.rsplit('.', 1)[-1]}; resume with the checkpoint's own config "
                          f"(config.yaml in its run directory) or start a new run")
    requested_model = dict(_plain(model_cfg.get("init_args") or {}))
    diffs = _differences("model", saved_model, requested_model, RESUMABLE_MODEL_OPTIONS)
    saved_data = state.get("datamodule_hyper_parameters")
    if saved_data is not None:
        diffs += _differences("data", dict(saved_data), dict(_plain(data_cfg)), RESUMABLE_DATA_OPTIONS)
    if diffs:
        more = f" (and {len(diffs) - 2} more)" if len(diffs) > 2 else ""
        raise FLUserError(f"--ckpt_path {path}: the checkpoint is of a different experiment: {'; '.join(diffs[:2])}"
                          f"{more}; only run length, devices, logging and analyses may change on resume")


# Options of a fit that may differ when it resumes: how long it runs, where and on how many
# processes it runs, and what it logs or analyses beside the rounds. Every other option (the
# method, the data, the federation's decisions, precision, clipping, seeds) must be the run's own,
# so that one run directory is one experiment and its config.yaml tells how every round was run.
RESUMABLE_OPTIONS = (
    "ckpt_path", "overwrite", "weights_only",
    "trainer.max_epochs", "trainer.max_time", "trainer.max_steps", "trainer.accelerator", "trainer.devices",
    "trainer.num_nodes", "trainer.strategy", "trainer.plugins", "trainer.logger", "trainer.callbacks",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.enable_checkpointing",
    "trainer.default_root_dir", "trainer.log_every_n_steps", "trainer.profiler",
    *(f"data.{key}" for key in sorted(RESUMABLE_DATA_OPTIONS)),
    "federation.parallel", "federation.client_cache_size", "federation.collective_timeout",
    "analysis",
)


def _may_change_on_resume(key: str) -> bool:
    return any(key == option or key.startswith(option + ".") for option in RESUMABLE_OPTIONS)


# An option newer than a run's config.yaml: the run ran as this value says (no engine but the
# sequential one existed).
BEFORE_THE_OPTION = {"federation.engine": "sequential"}
# An option that only another option's choice reads: changing it changes nothing while neither the
# run nor the request makes that choice (the clients trained together, with the sequential engine).
READ_ONLY_WITH = {"federation.engine_group": ("federation.engine", "vectorized")}


def _changes_results(key: str, saved: Mapping, requested: Mapping) -> bool:
    if _may_change_on_resume(key) or saved.get(key) == requested.get(key):
        return False
    reader = READ_ONLY_WITH.get(key)
    return reader is None or reader[1] in (saved.get(reader[0]), requested.get(reader[0]))


def check_resume_options(path: str | Path, run_config: Path, requested_yaml: str) -> None:
    """Refuse a resume that changes an option which changes results (see `RESUMABLE_OPTIONS`):
    the run's config.yaml would otherwise be rewritten with the new value, and the record would no
    longer show that the earlier rounds ran without it. `requested_yaml` is the requested config
    as the fit writes config.yaml."""
    if not run_config.is_file():
        return  # a checkpoint carried away from its run: check_compatible has checked what it holds
    try:
        saved = flatten_options(yaml.safe_load(run_config.read_text()) or {})
    except (OSError, yaml.YAMLError) as err:
        raise FLUserError(f"--ckpt_path {path}: the run's {run_config} cannot be read ({type(err).__name__}); "
                          f"the resume is checked against it") from None
    requested = flatten_options(yaml.safe_load(requested_yaml) or {})
    saved = {**{k: v for k, v in BEFORE_THE_OPTION.items() if k in requested}, **saved}
    changed = [key for key in sorted(set(saved) | set(requested)) if _changes_results(key, saved, requested)]
    if changed:
        key = changed[0]
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])})" if len(changed) > 1 else ""
        was, now = (json.dumps(cfg.get(key), default=str) for cfg in (saved, requested))
        raise FLUserError(f"--ckpt_path {path}: --{key} is {was} in the run ({run_config}), requested {now}{more}; "
                          f"an option that changes results cannot change on resume: resume with the run's own "
                          f"value, or start a new run in another directory (only run length, devices, logging "
                          f"and analyses may change)")
