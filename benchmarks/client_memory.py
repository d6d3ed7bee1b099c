"""Peak memory against the number of clients: idle clients must cost (almost) nothing.

    PYTHONPATH=. python benchmarks/client_memory.py [--rounds 2]

Each configuration runs in its own process (peak RSS, `ru_maxrss`, is per process), on MNIST-5k,
10 clients per round, one local epoch, with a checkpoint every round (so the client-state store
has its directory, as in a CLI run):

  (a) FedAvg, the FedAvg CNN, 100 against 1,000 clients: the server keeps one global model; an idle
      client is only its partition's indices.
  (b) LG-FedAvg with every client's own FedAvg-CNN (images resized to 14x14, 1.3 MiB per client),
      a client cache of 50, 200 against 1,000 clients: client models live in the store (files
      next to the checkpoint), at most 50 of them in memory. The old core held every client's
      model in RAM; its extra memory is printed for reference (N x the model's bytes).

For each pair it prints peak RSS, the peak above the RSS before fitting (imports and data), and
the ratio of the larger run's increase to the smaller one's (1.0 = flat in N).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

CONFIGS = {  # name: (method, clients, cache size)
    "fedavg-100": ("FedAvg", 100, 0),
    "fedavg-1000": ("FedAvg", 1000, 0),
    "lgfedavg-200-cache50": ("LGFedAvg", 200, 50),
    "lgfedavg-1000-cache50": ("LGFedAvg", 1000, 50),
}


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(name: str, rounds: int) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fl_lightning.data.datamodule import FederatedDataModule
    from fl_lightning.federation import FederatedCallback
    from fl_lightning.methods import FedAvg, LGFedAvg

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    method_name, clients, cache = CONFIGS[name]
    torch.manual_seed(0)
    common = dict(dataset="mnist5k", num_clients=clients, sample_ratio=10 / clients, local_epochs=1,
                  batch_size=10, partition="iid", min_size=1)
    if method_name == "FedAvg":
        dm = FederatedDataModule(**common)
        method = FedAvg(model="fedavg_cnn", lr=0.01, data_spec=dm.spec)
    else:
        dm = FederatedDataModule(**common, client_test_fraction=0.25, resize=14)
        method = LGFedAvg(model="fedavg_cnn", feature_dim=64, data_spec=dm.spec)
    dm.setup("fit")
    before = rss_mib()
    with tempfile.TemporaryDirectory() as root:
        ckpt_dir = Path(root) / "checkpoints"
        trainer = L.Trainer(max_epochs=rounds, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu", devices=1, default_root_dir=root,
                            callbacks=[FederatedCallback(eval_local_models=False, client_cache_size=cache),
                                       ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1)])
        start = time.perf_counter()
        trainer.fit(method, dm)
        seconds = time.perf_counter() - start
        model_bytes = 0
        if method_name != "FedAvg":
            model_bytes = sum(t.numel() * t.element_size() for t in method.client_models[0].state_dict().values())
            files = sum(p.stat().st_size for p in (ckpt_dir / "client_states").rglob("*.safetensors"))
        else:
            files = 0
    return {"before": before, "peak": rss_mib(), "seconds": seconds, "model_mib": model_bytes / 2**20,
            "files_mib": files / 2**20, "clients": clients}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.rounds)))
        return
    results = {}
    for name in CONFIGS:
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--rounds", str(args.rounds)],
                              capture_output=True, text=True, check=True)
        results[name] = r = json.loads(proc.stdout.strip().splitlines()[-1])
        extra = f", client files {r['files_mib']:.0f} MiB on disk" if r["files_mib"] else ""
        print(f"{name:24s} peak RSS {r['peak']:7.0f} MiB, above start {r['peak'] - r['before']:6.0f} MiB, "
              f"fit {r['seconds']:5.1f} s{extra}")
    for small, large in (("fedavg-100", "fedavg-1000"), ("lgfedavg-200-cache50", "lgfedavg-1000-cache50")):
        a, b = results[small], results[large]
        grow_a, grow_b = a["peak"] - a["before"], b["peak"] - b["before"]
        print(f"{large} / {small}: peak {b['peak'] / a['peak']:.2f}x, increase over start "
              f"{grow_b / grow_a:.2f}x ({grow_b - grow_a:+.0f} MiB for {b['clients'] - a['clients']} more clients)")
        if b["model_mib"]:
            print(f"  the old core kept every client's model in RAM: {a['clients'] * a['model_mib']:.0f} MiB "
                  f"and {b['clients'] * b['model_mib']:.0f} MiB of client models")


if __name__ == "__main__":
    main()
