"""W&B logging that never blocks on the network: offline unless the user is logged in."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import WandbLogger


def wandb_logged_in() -> bool:
    """True when wandb has an API key: WANDB_API_KEY or the ~/.netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        hosts = netrc.netrc(path).hosts if path.exists() else {}
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


class FLWandbLogger(WandbLogger):
    """WandbLogger whose `offline` defaults to "not logged in" (or WANDB_MODE); upload an offline
    run later with `wandb sync <dir>`."""

    def __init__(self, offline: bool | None = None, project: str = "fl-lightning", save_dir: str | None = None,
                 **kwargs):
        # The CLI sets save_dir to the run's trainer.default_root_dir, so each run keeps its config,
        # checkpoints and W&B files together.
        save_dir = save_dir or "runs"
        if offline is None:
            mode = os.environ.get("WANDB_MODE", "")
            offline = mode in ("offline", "dryrun", "disabled") or not wandb_logged_in()
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(offline=offline, project=project, save_dir=save_dir, **kwargs)


class IncompleteRunFile(ValueError):
    """The .wandb file has no exit record yet: W&B has not finished writing it."""


def read_offline_history(run_file: str | Path, require_complete: bool = True) -> list[dict]:
    """The metric rows of an offline W&B run (`run-<id>.wandb`), read without a W&B server (wandb
    ships no reader for these files).

    The file is a LevelDB-style record log (7-byte ':W&B' header, 32 KiB blocks of records with a
    crc32/length/type header, types FULL/FIRST/MIDDLE/LAST) of `wandb_internal_pb2.Record`
    protobufs. W&B's core process writes it in whole blocks, and `wandb.finish()` can return before
    the last block reaches the disk (a small run's file is then only the 7-byte header); so a run
    counts as readable only once its `exit` record is there, which `finish_wandb` in the CLI waits
    for. A record whose checksum does not match is an error, never skipped silently.
    """
    import json
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    block, pos, rows, pending, complete = 32768, 7, [], b"", False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block if pos % block else 0
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            break  # the tail of a file still being written
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"{run_file}: damaged record at byte {pos} (checksum mismatch)")
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        which = record.WhichOneof("record_type")
        if which == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif which == "exit":
            complete = True
    if require_complete and not complete:
        raise IncompleteRunFile(f"{run_file}: no exit record; W&B has not finished writing this run "
                                f"(or it was killed)")
    return rows
