"""FedSOL's Fig. 3 claim at fixed weights: cos(g_u, g_p) against rho, with the trajectory held still.

`fedsol/cos_update_prox` in a run averages cos(g_u, g_p) over every local step of a round, and the
steps differ between values of rho (a larger rho keeps local models nearer the global one), so a
rho sweep of runs mixes the effect of rho with that of where training went. Proposition 1 of the
paper is a statement at one point w: g_u(rho) = grad L_CE(w + eps_p(rho)) ~ g_l + rho H g_p_hat,
so <g_u, g_p> grows with rho when H is PSD. This script measures that directly: from a global model
(random init, or `--ckpt`), each of a round's clients takes one local epoch of FedAvg SGD to a w_k
!= w_g; on its next batches g_p = grad KL(global || local) and g_u(rho) are computed at that same
w_k for every rho, with the perturbation of `FedSOL` itself (`sol_perturbation`), and the cosines
over all tensors and over the head are averaged over clients and batches.

    python benchmarks/fedsol_cosine_vs_rho.py [--ckpt runs/mnist5k/fedsol/checkpoints/last.ckpt]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fl_lightning.data.datamodule import FederatedDataModule
from fl_lightning.methods.fedsol.fedsol import kl_proximal_loss, sol_perturbation
from fl_lightning.models import build_model

DATA = dict(dataset="mnist5k", num_clients=50, sample_ratio=0.2, local_epochs=5, batch_size=50,
            partition="dirichlet", alpha=0.1, partition_seed=0, seed=0)
RHOS = (0.0, 0.1, 0.5, 2.0, 8.0)


def cos(a: dict, b: dict, names) -> float:
    dot = sum(float((a[n] * b[n]).sum()) for n in names)
    na = sum(float((a[n] ** 2).sum()) for n in names) ** 0.5
    nb = sum(float((b[n] ** 2).sum()) for n in names) ** 0.5
    return dot / max(na * nb, 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--round", type=int, default=3, help="whose sampled clients to use")
    parser.add_argument("--batches", type=int, default=3, help="batches per client to measure on")
    args = parser.parse_args()
    torch.manual_seed(0)
    dm = FederatedDataModule(**DATA)
    dm.setup()
    global_model = build_model("fedavg_cnn", dm.spec)
    if args.ckpt:
        state = torch.load(args.ckpt, map_location="cpu", weights_only=True)["state_dict"]
        global_model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    global_model.eval()
    w_g = {n: p.detach().clone() for n, p in global_model.named_parameters()}
    head = [n for n in w_g if n.startswith("head.")]
    results: dict[tuple, list[tuple[float, float]]] = {}
    for steps in dm.plan_round(args.round - 1).clients:
        local = copy.deepcopy(global_model).train()
        opt = torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
        loader = dm.client_loader(steps.client, shuffle=True, seed=steps.client)
        for x, y in loader:  # one local epoch of plain SGD: w_k != w_g
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()
        w = {n: p.detach().clone().requires_grad_(True) for n, p in local.named_parameters()}
        for b, (x, y) in enumerate(loader):
            if b >= args.batches:
                break
            with torch.no_grad():
                z_g = global_model(x)
            prox = kl_proximal_loss(functional_call(local, w, (x,)), z_g, 3.0)
            g_p = dict(zip(w, torch.autograd.grad(prox, list(w.values())), strict=True))
            for perturb in ("head", "all"):
                names = head if perturb == "head" else list(w)
                for adaptive in ("layer", "none"):
                    for rho in RHOS:
                        eps = sol_perturbation([w[n] for n in names], [g_p[n] for n in names],
                                               [w_g[n] for n in names], rho, adaptive)
                        shifted = {**w, **{n: w[n] + e for n, e in zip(names, eps, strict=True)}}
                        loss = F.cross_entropy(functional_call(local, shifted, (x,)), y)
                        g_u = dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
                        norm = sum(float((e**2).sum()) for e in eps) ** 0.5
                        results.setdefault((perturb, adaptive, rho), []).append(
                            (cos(g_u, g_p, list(w)), cos(g_u, g_p, head), norm))
    print(f"global model: {'--ckpt ' + args.ckpt if args.ckpt else 'random init'}; clients of round {args.round}, "
          f"each after one local epoch, {args.batches} batches each")
    print("perturb adaptive   rho   cos(g_u,g_p) all   cos head   ||eps||")
    for (perturb, adaptive, rho), vals in results.items():
        n = len(vals)
        mean = [sum(v[i] for v in vals) / n for i in range(3)]
        print(f"{perturb:7s} {adaptive:8s} {rho:5.1f}   {mean[0]:+.4f}           {mean[1]:+.4f}    {mean[2]:.3g}")


if __name__ == "__main__":
    main()
