"""Every client's persistent state in one place: SCAFFOLD's c_i, FedDyn's g_i, MOON's previous
model, Ditto's personal model, FedPer/FedRep heads, FedKD's W_h and the model-heterogeneous
clients' own models (under `model.`), one dict of tensors per client.

`ClientStateStore` behaves like a dict {client: {name: tensor}}, but keeps at most `cache_size`
clients in memory (least recently used first out; 0 = unlimited) and writes the rest to one
safetensors file per client and version in the run directory. A file is written atomically
(temporary file in the same directory, fsync, rename) and never overwritten: a changed state gets
a new version. The round checkpoint stores only the manifest, after writing the states that changed
since the last checkpoint, so a checkpoint costs in proportion to the clients that trained, not to
all clients. Files are deleted only once neither the checkpoint being written nor the previous one
names them, so a kill at any moment, even while a checkpoint is being written, leaves every state
the surviving checkpoint needs.

A damaged or swapped file is refused, never used. The manifest records, for every client, its
file's name (relative to the store's folder, so a run directory can be moved), size and CRC-32
checksum, and each file carries its client's id in its metadata; a file is checked against them
whenever it is read (and `verify` checks them all before a resume starts), and a mismatch ends the
run with one line naming the file and the client (`ClientStateError`, exit code 2).

When a round's clients train on several processes (parallel.py), each process has its own store
over the same folder, and writes its files into a subfolder of its own (`rank<r>/`; rank 0 into
the folder itself). A state changes on the process that trained the client; after the round
(`sync`) every process writes what it changed and learns where the others wrote theirs, dropping
its stale cached copies: the one mechanism that moves client state between processes, for every
kind of state. So a state moves only when another process needs it, every process's manifest is
the same, and the round checkpoint (written by rank 0) names every client's state exactly once.
A process deletes only files in its own subfolder that no recent manifest names. States that every
process built identically (heterogeneous clients' initial models, drawn from the run's seed) are
not published (`mark_synced`): each process keeps its own copy.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from fl_lightning.atomic import atomic_write_bytes
from fl_lightning.errors import FLUserError

State = dict[str, torch.Tensor]
FILE_PATTERN = "client*.v*.safetensors"


class ClientStateError(FLUserError):
    """A client-state file is missing, damaged, swapped or foreign: refused in one line (exit 2)."""


@dataclass(frozen=True)
class FileRecord:
    """One client's state file: its name in the store's folder (or in `base`, the folder of the
    checkpoint it was loaded from, when that is another one), its size and checksum."""

    name: str
    size: int
    checksum: str  # `_checksum` of the file's bytes
    base: str | None = None

    def as_list(self) -> list:
        return [self.name, self.size, self.checksum]


def _checksum(data: bytes) -> str:
    """A file's CRC-32, as "crc32:<hex>". It detects every error burst up to 32 bits and any other
    damage but with probability 2**-32 (it guards against disks and mistakes, not tampering),
    several times faster than a cryptographic hash: a file is checked whenever it is read."""
    return f"crc32:{zlib.crc32(data):08x}"


def _matches(data: bytes, recorded: str) -> bool:
    if recorded.startswith("crc32:"):
        return _checksum(data) == recorded
    return hashlib.blake2b(data, digest_size=16).hexdigest() == recorded  # checkpoints before CRC-32


class ClientStateStore(MutableMapping):
    """{client: state} with a bounded cache over checked per-client files (see the module docstring).

    Args:
        directory: where the files go; None keeps everything in memory (no bound, nothing on disk).
        cache_size: clients held in memory at most (0 = unlimited).
    """

    def __init__(self, directory: str | Path | None = None, cache_size: int = 0):
        self._cache: OrderedDict[int, State] = OrderedDict()
        self._dirty: set[int] = set()  # in the cache and changed since written
        self._unpublished: set[int] = set()  # changed since the last `sync` (written or not)
        self._files: dict[int, FileRecord] = {}  # client -> its newest file
        self._version = 0
        self._previous_manifest: set[str] = set()
        self.rank = 0  # this process's rank among the processes that train a round's clients
        self.directory: Path | None = None
        self.cache_size = 0
        self.bytes_written = 0
        self.configure(directory, cache_size)

    def configure(self, directory: str | Path | None, cache_size: int = 0, rank: int = 0) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0 (0 = unlimited), got {cache_size}")
        self.directory = None if directory is None else Path(directory)
        self.cache_size, self.rank = cache_size, rank
        if self.cache_size and self.directory is None:
            raise ValueError("a bounded client-state cache needs a directory for the files")
        self._evict()

    # ---- dict interface ---------------------------------------------------------------------
    def __getitem__(self, client: int) -> State:
        client = int(client)
        if client in self._cache:
            self._cache.move_to_end(client)
            return self._cache[client]
        if client not in self._files:
            raise KeyError(client)
        state = self._read(client)
        self._cache[client] = state
        self._evict()
        return state

    def __setitem__(self, client: int, state: Mapping[str, torch.Tensor]) -> None:
        client = int(client)
        self._cache[client] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        self._cache.move_to_end(client)
        self._dirty.add(client)
        self._unpublished.add(client)
        self._evict()

    def __delitem__(self, client: int) -> None:
        client = int(client)
        if client not in self:
            raise KeyError(client)
        self._cache.pop(client, None)
        self._files.pop(client, None)
        self._dirty.discard(client)
        self._unpublished.discard(client)

    def __contains__(self, client: object) -> bool:
        return client in self._cache or client in self._files

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(set(self._cache) | set(self._files)))

    def __len__(self) -> int:
        return len(set(self._cache) | set(self._files))

    # ---- files ------------------------------------------------------------------------------
    def _path(self, record: FileRecord) -> Path:
        if record.base is not None:
            return Path(record.base) / record.name
        if self.directory is None:
            raise RuntimeError("the client-state store has files but no directory")
        return self.directory / record.name

    @property
    def own_folder(self) -> str:
        """This process's subfolder of the store's folder ("" for rank 0)."""
        return f"rank{self.rank}/" if self.rank else ""

    def _write(self, client: int) -> None:
        self._version += 1
        name = f"{self.own_folder}client{client}.v{self._version}.safetensors"
        tensors = {k: v.detach().cpu().contiguous() for k, v in self._cache[client].items()}
        data = save(tensors, metadata={"client": str(client)})
        atomic_write_bytes(self.directory / name, data)
        self.bytes_written += len(data)
        self._files[client] = FileRecord(name, len(data), _checksum(data))
        self._dirty.discard(client)

    def _refuse(self, client: int, record: FileRecord, problem: str) -> ClientStateError:
        return ClientStateError(
            f"client-state file {self._path(record)} (client {client}) {problem}; the run cannot continue "
            f"exactly without it: restore the file from a copy of the run directory, or start the run again "
            f"(--overwrite true)")

    def _read(self, client: int) -> State:
        """The client's state from its file, after checking the file is the one the manifest names."""
        record = self._files[client]
        path = self._path(record)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise self._refuse(client, record, "is missing") from None
        except OSError as err:
            raise self._refuse(client, record, f"cannot be read ({err.strerror or err})") from None
        self._check_bytes(client, record, data)
        try:
            return load(data)
        except (SafetensorError, ValueError) as err:  # pragma: no cover - the checksum matched
            raise self._refuse(client, record, f"is not a readable safetensors file ({err})") from None

    def _check_bytes(self, client: int, record: FileRecord, data: bytes) -> None:
        if len(data) == record.size and _matches(data, record.checksum):
            return
        owner = _owner(data)
        if owner is not None and owner != client:
            raise self._refuse(client, record, f"holds client {owner}'s state (files swapped?)")
        if len(data) != record.size:
            raise self._refuse(client, record, f"has {len(data)} bytes where the checkpoint recorded {record.size} "
                                               f"(truncated, emptied or replaced)")
        raise self._refuse(client, record, "does not match its checksum (changed or corrupted after it was written)")

    def verify(self) -> None:
        """Reads every file the manifest names and checks it (size, checksum, client id): before a
        resume starts, so a damaged run directory is refused at once, not rounds later."""
        for client, record in sorted(self._files.items()):
            if client in self._cache and client in self._dirty:
                continue
            try:
                data = self._path(record).read_bytes()
            except FileNotFoundError:
                raise self._refuse(client, record, "is missing") from None
            except OSError as err:
                raise self._refuse(client, record, f"cannot be read ({err.strerror or err})") from None
            self._check_bytes(client, record, data)

    def _evict(self) -> None:
        while self.cache_size and len(self._cache) > self.cache_size:
            client = next(iter(self._cache))  # least recently used
            if client in self._dirty:
                self._write(client)
            del self._cache[client]

    def manifest(self) -> dict[int, FileRecord]:
        """Writes every changed state, and every state still in the folder of a checkpoint loaded
        from elsewhere (a run resumed into another directory brings its states along), and returns
        {client: file record} naming all of them."""
        if self.directory is None:
            return {}
        for client in sorted(c for c, r in self._files.items() if r.base is not None):
            self[client] = self[client]  # read (and checked) there, written here
        for client in sorted(self._dirty):
            self._write(client)
        return dict(sorted(self._files.items()))

    def checkpoint_state(self) -> dict:
        """What the round checkpoint records (rank 0 writes it: its states are written first);
        every process then prunes the files of its own subfolder that neither this checkpoint nor
        the previous one names."""
        if self.directory is None:
            return {"states": {c: dict(s) for c, s in self._cache.items()}}
        manifest = self.manifest() if self.rank == 0 else dict(sorted(self._files.items()))
        names = {record.name for record in manifest.values()}
        folder = self.directory / self.own_folder
        if folder.is_dir():
            for path in folder.glob(FILE_PATTERN):
                name = f"{self.own_folder}{path.name}"
                if name not in names and name not in self._previous_manifest:
                    path.unlink(missing_ok=True)
        self._previous_manifest = names
        return {"manifest": {c: r.as_list() for c, r in manifest.items()}, "version": self._version}

    def mark_synced(self) -> None:
        """The states set so far are the same on every process (built from the same seed): none
        of them needs publishing at the next `sync`."""
        self._unpublished.clear()

    def sync(self, collective) -> None:
        """After a round whose clients trained on several processes (`parallel.Collective`):
        every process publishes the states it changed (written to files, or the states
        themselves for a store without a directory) and takes the others'. A no-op otherwise."""
        if not collective.distributed:
            return
        changed, self._unpublished = sorted(self._unpublished), set()
        if self.directory is None:  # in memory: every process keeps every state
            for rank, part in enumerate(collective.gather({c: self._cache[c] for c in changed})):
                if rank != self.rank:
                    for client, state in part.items():
                        self._cache[client] = state
            return
        for client in sorted(self._dirty & set(changed)):
            self._write(client)
        # every state changed this round, including those evicted (written) during it
        written = {client: self._files[client] for client in changed}
        parts = collective.gather((self._version, written))
        self._version = max(version for version, _ in parts)  # no process reuses a name
        for rank, (_, part) in enumerate(parts):
            if rank == self.rank:
                continue
            for client, record in part.items():
                self._files[client] = record
                self._cache.pop(client, None)  # stale: another process trained it since
                self._dirty.discard(client)

    def load_checkpoint_state(self, saved: Mapping, base: str | Path | None = None) -> None:
        """Takes a checkpoint's record (`checkpoint_state`) whose files are in `base` (default:
        this store's folder). The files are checked when read, and all at once by `verify`."""
        self._cache.clear()
        self._dirty.clear()
        self._unpublished.clear()
        self._files = {}
        if "states" in saved or not saved:
            for client, state in saved.get("states", {}).items():
                self[int(client)] = state
            self._unpublished.clear()
            return
        manifest = saved.get("manifest")
        if not isinstance(manifest, Mapping) or any(not isinstance(r, list | tuple) for r in manifest.values()):
            raise ClientStateError("the checkpoint's client-state manifest is from an earlier fl-lightning version "
                                   "(absolute paths, no checksums); resume it with that version or start the run "
                                   "again (--overwrite true)")
        if base is not None and self.directory is not None and Path(base) == self.directory:
            base = None
        self._files = {int(c): FileRecord(str(r[0]), int(r[1]), str(r[2]), None if base is None else str(base))
                       for c, r in manifest.items()}
        self._version = max(self._version, int(saved["version"]))
        self._previous_manifest = {record.name for record in self._files.values()}


def _owner(data: bytes) -> int | None:
    """The client id a safetensors file's metadata names (None when it has none or is unreadable)."""
    import json
    import struct

    try:
        length = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + length])
        return int(header.get("__metadata__", {}).get("client"))
    except (ValueError, TypeError, struct.error):
        return None


def read_client_states(saved: Mapping, directory: str | Path | None = None) -> dict[int, State]:
    """Every client's state as a checkpoint records it (`fl_client_states`: the manifest of files
    in `directory`, the checkpoint's `client_states/` folder, or the states themselves)."""
    store = ClientStateStore()
    store.load_checkpoint_state(saved, base=directory)
    return {client: store[client] for client in store}
