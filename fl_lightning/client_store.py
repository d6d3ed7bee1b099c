"""Persistent per-client state (SCAFFOLD's c_i, FedDyn's g_i, MOON's previous model, Ditto's v_k,
FedPer/FedRep heads, FedKD's W_h, heterogeneous clients' own models) off the heap.

`ClientStateStore` behaves like a dict {client: {name: tensor}}, but keeps at most `cache_size`
clients in memory (least recently used first out; 0 = unlimited) and writes the rest to one
safetensors file per client and version in the run directory. A file is written atomically
(temporary file in the same directory, fsync, rename) and never overwritten: a changed state gets
a new version. The round checkpoint stores only the manifest (client -> file) after writing the
states that changed since the last checkpoint, so a checkpoint costs in proportion to the clients
that trained, not to all clients. Files are deleted only once neither the checkpoint being
written nor the previous one names them, so a kill at any moment, even while a checkpoint is
being written, leaves every state the surviving checkpoint needs.

When a round's clients train on several processes (parallel.py), each process has its own store
over the same directory. A state changes on the process that trained the client; after the round
(`sync`) every process writes what it changed (file names carry the process's rank) and learns
where the others wrote theirs, dropping its stale cached copies. So a state moves between
processes only when its client changes process, every process's manifest is the same, and the
round checkpoint (written by rank 0) names every client's state exactly once. Only rank 0 deletes
files.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from fl_lightning.atomic import atomic_write_bytes

State = dict[str, torch.Tensor]


def state_digest(state: State) -> str:
    """A hash of the tensors' names, dtypes, shapes and bytes (equal iff the states are equal)."""
    h = hashlib.blake2b(digest_size=16)
    for key, t in state.items():
        t = t.detach().cpu().contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_atomically(state: State, path: Path) -> None:
    atomic_write_bytes(path, save({k: v.detach().cpu().contiguous() for k, v in state.items()}))


def read_client_states(saved: dict) -> dict[int, State]:
    """Every client's state as a checkpoint records it (`fl_client_states`, either the manifest
    of files or, for a run without a checkpoint directory, the states themselves)."""
    store = ClientStateStore()
    store.load_checkpoint_state(saved if ("manifest" in saved or "states" in saved) else {"states": saved})
    return {client: store[client] for client in store}


class ClientStateStore(MutableMapping):
    """{client: state} with a bounded cache over per-client files (see the module docstring).

    Args:
        directory: where the files go; None keeps everything in memory (no bound, nothing on disk).
        cache_size: clients held in memory at most (0 = unlimited).
    """

    def __init__(self, directory: str | Path | None = None, cache_size: int = 0):
        self._cache: OrderedDict[int, State] = OrderedDict()
        self._dirty: set[int] = set()  # in the cache and changed since written
        self._unpublished: set[int] = set()  # changed since the last `sync` (written or not)
        self._files: dict[int, Path] = {}  # client -> its newest file
        self._version = 0
        self._previous_manifest: dict[int, str] = {}
        self.rank = 0  # set by `sync`: names this process's files and lets only rank 0 delete
        self.directory: Path | None = None
        self.cache_size = 0
        self.configure(directory, cache_size)
        self.bytes_written = 0

    def configure(self, directory: str | Path | None, cache_size: int = 0) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0 (0 = unlimited), got {cache_size}")
        self.directory = None if directory is None else Path(directory)
        self.cache_size = cache_size
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
        state = load_file(str(self._files[client]))
        self._cache[client] = state
        self._evict()
        return state

    def __setitem__(self, client: int, state: State) -> None:
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
    def _write(self, client: int) -> None:
        self._version += 1
        rank = f".r{self.rank}" if self.rank else ""
        path = self.directory / f"client{client}.v{self._version}{rank}.safetensors"
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self._cache[client], path)
        self.bytes_written += path.stat().st_size
        self._files[client] = path
        self._dirty.discard(client)

    def _evict(self) -> None:
        while self.cache_size and len(self._cache) > self.cache_size:
            client = next(iter(self._cache))  # least recently used
            if client in self._dirty:
                self._write(client)
            del self._cache[client]

    def manifest(self) -> dict[int, str]:
        """Writes every changed state and returns {client: file} naming all of them; with no
        directory the states themselves (an in-memory run checkpoints them whole)."""
        if self.directory is None:
            return {}
        for client in sorted(self._dirty):
            self._write(client)
        return {c: str(p) for c, p in sorted(self._files.items())}

    def checkpoint_state(self) -> dict:
        """What the round checkpoint records; prunes files no recent checkpoint names."""
        if self.directory is None:
            return {"states": {c: dict(s) for c, s in self._cache.items()}}
        manifest = self.manifest()
        keep = set(manifest.values()) | set(self._previous_manifest.values())
        if self.directory.is_dir() and self.rank == 0:
            for path in self.directory.glob("client*.v*.safetensors"):
                if str(path) not in keep:
                    path.unlink(missing_ok=True)
        self._previous_manifest = manifest
        return {"manifest": manifest, "version": self._version}

    def sync(self, collective) -> None:
        """After a round whose clients trained on several processes (`parallel.Collective`):
        every process publishes the states it changed (written to files, or the states
        themselves for a store without a directory) and takes the others'. A no-op otherwise."""
        if not collective.distributed:
            return
        self.rank = collective.rank
        changed, self._unpublished = sorted(self._unpublished), set()
        if self.directory is None:  # in memory: every process keeps every state
            mine = {c: self._cache[c] for c in changed}
            for part in collective.gather(mine):
                for client, state in part.items():
                    self._cache[client] = state
            return
        for client in sorted(self._dirty):
            self._write(client)
        # every state changed this round, including those evicted (written) during it
        written = {client: str(self._files[client]) for client in changed}
        parts = collective.gather((self._version, written))
        self._version = max(version for version, _ in parts)  # no process reuses a name
        for rank, (_, part) in enumerate(parts):
            if rank == self.rank:
                continue
            for client, path in part.items():
                self._files[client] = Path(path)
                self._cache.pop(client, None)  # stale: another process trained it since

    def release(self) -> None:
        """Drops the cached states that are safely in files (memory for states that live
        elsewhere too, e.g. heterogeneous client models)."""
        if self.directory is not None:
            for client in [c for c in self._cache if c not in self._dirty and c in self._files]:
                del self._cache[client]

    def load_checkpoint_state(self, saved: dict) -> None:
        self._cache.clear()
        self._dirty.clear()
        self._unpublished.clear()
        self._files = {}
        if "states" in saved:
            for client, state in saved["states"].items():
                self[int(client)] = state
            return
        self._files = {int(c): Path(p) for c, p in saved["manifest"].items()}
        missing = [str(p) for p in self._files.values() if not p.exists()]
        if missing:
            raise FileNotFoundError(f"the checkpoint needs client-state files that are gone: {missing[0]}")
        self._version = max(self._version, int(saved["version"]))
        self._previous_manifest = {c: str(p) for c, p in self._files.items()}
