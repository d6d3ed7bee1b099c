"""FedORGP's baselines: each server and client update against its formula on tiny models."""

import copy
import math

import torch
import torch.nn.functional as F
from fl_test_utils import fit, one_client_module, toy_data

from fl_lightning.methods import FML, FedGH, FedKD, FedProto, FedTGP, LGFedAvg
from fl_lightning.methods.hetero.fml_fedkd import compress_state, decompress_state, svd_compress
from fl_lightning.methods.hetero.prototypes import client_prototypes, margin_contrastive_loss


def _two_clients(cls, n=24, **kw):
    torch.manual_seed(0)
    x, y = toy_data(n=n, channels=1, size=4, num_classes=3)
    dm = one_client_module(x, y, num_classes=3, num_clients=2, client_test_fraction=0.25)
    dm.setup()
    if cls in (FML, FedKD):
        kw.setdefault("shared_model", "mlp")
    method = cls(model="mlp", feature_dim=16, data_spec=dm.spec, **kw)
    method.build_client_models(2)
    uploads = []
    step = method.server_step
    method.server_step = lambda ups: (uploads.extend(ups), step(ups))[1]
    return method, dm, x, y, uploads


def test_lg_fedavg_averages_heads_by_samples_and_sends_them_to_everyone():
    method, dm, x, y, uploads = _two_clients(LGFedAvg)
    heads0 = [copy.deepcopy(m.head.state_dict()) for m in method.client_models]
    torch.testing.assert_close(heads0[0], heads0[1])  # one shared initial head
    fit(method, dm, rounds=1)
    assert all(set(u.groups) == {"head"} and set(u.group("head")) == {"weight", "bias"} for u in uploads)
    n = [u.num_samples for u in uploads]
    assert n == [len(p) for p in dm.client_parts]
    for key in ("weight", "bias"):
        expected = sum(u.group("head")[key] * w for u, w in zip(uploads, n, strict=True)) / sum(n)
        for model in method.client_models:
            torch.testing.assert_close(getattr(model.head, key).detach(), expected)


def test_fedgh_trains_the_global_head_on_prototypes():
    method, dm, x, y, uploads = _two_clients(FedGH, server_epochs=20, head_lr=0.5)
    head0 = copy.deepcopy(method.server["global_head"])
    fit(method, dm, rounds=1)
    assert all(set(u.groups) == {"prototypes"} and u.group("prototypes") for u in uploads)
    protos = torch.stack([p for u in uploads for p in client_prototypes(u).values()])
    labels = torch.tensor([c for u in uploads for c in client_prototypes(u)])
    with torch.no_grad():
        before = F.cross_entropy(head0(protos), labels)
        after = F.cross_entropy(method.server["global_head"](protos), labels)
    assert after < before - 1e-3
    for model in method.client_models:
        torch.testing.assert_close(model.head.weight.detach(), method.server["global_head"].weight.detach())


def test_fedproto_mean_prototypes_mse_loss_and_nearest_prototype_prediction():
    method, dm, x, y, uploads = _two_clients(FedProto, lam=2.0, lr=0.1)
    fit(method, dm, rounds=1)
    for c in range(3):
        ps = [client_prototypes(u)[c] for u in uploads if c in client_prototypes(u)]
        torch.testing.assert_close(method.global_protos[c], torch.stack(ps).mean(0))  # unweighted
    # local loss of round 2: CE + lam * MSE(f, P^y)
    model = method.client_models[0]
    method.model = model
    xb, yb = x[:6], y[:6]
    feats = model.features(xb)
    expected = F.cross_entropy(model.head(feats), yb) + 2.0 * F.mse_loss(feats, method.global_protos[yb])
    torch.testing.assert_close(method.loss(model, (xb, yb), method.loss_context()), expected)
    # prediction: the nearest global prototype
    logits = method.predict_logits(xb)
    nearest = torch.cdist(feats, method.global_protos).argmin(1)
    assert torch.equal(logits.argmax(1), nearest)
    method.model = None


def test_fedtgp_margin_loss_and_adaptive_margin():
    g = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    p = torch.tensor([[1.0, 0.0]])
    y = torch.tensor([0])
    d0, d1 = 1.0, math.hypot(2.0, 4.0)
    margin = 2.5
    expected = -math.log(math.exp(-(d0 + margin)) / (math.exp(-(d0 + margin)) + math.exp(-d1)))
    assert math.isclose(float(margin_contrastive_loss(p, y, g, margin)), expected, rel_tol=1e-5)

    method, *_ = _two_clients(FedTGP, margin_threshold=100.0)
    protos = torch.tensor([[0.0, 0.0], [0.0, 2.0], [6.0, 0.0], [6.0, 0.0]]).repeat(1, 8)
    labels = torch.tensor([0, 0, 1, 2])  # class means: (0,1), (6,0), (6,0) per pair of dims
    # gaps: class 0 -> sqrt(36+1) * sqrt(8), classes 1, 2 -> 0; margin = max gap
    assert math.isclose(method.adaptive_margin(protos, labels), math.sqrt(37 * 8), rel_tol=1e-5)
    method.hparams.margin_threshold = 3.0
    assert method.adaptive_margin(protos, labels) == 3.0


def test_fml_local_loss_is_the_mutual_distillation_formula():
    method, dm, x, y, _ = _two_clients(FML, alpha=0.3, beta=0.6)
    model = method.client_models[0]
    method.model = model
    xb, yb = x[:6], y[:6]
    z, zg = model(xb), method.shared(xb)

    def kl(p_logits, q_logits):  # KL(softmax(q) || softmax(p)), batch mean
        q = F.softmax(q_logits, 1)
        return (q * (F.log_softmax(q_logits, 1) - F.log_softmax(p_logits, 1))).sum(1).mean()

    expected = (0.3 * F.cross_entropy(z, yb) + 0.7 * kl(z, zg)) + (
        0.6 * F.cross_entropy(zg, yb) + 0.4 * kl(zg, z)
    )
    torch.testing.assert_close(method.loss(model, (xb, yb), method.loss_context()), expected)
    method.model = None


def test_fml_shared_model_is_the_sample_weighted_average():
    method, dm, x, y, uploads = _two_clients(FML)
    fit(method, dm, rounds=1)
    n = [u.num_samples for u in uploads]
    for k, v in method.server["global_shared"].state_dict().items():
        expected = sum(u.group("shared")[k] * w for u, w in zip(uploads, n, strict=True)) / sum(n)
        torch.testing.assert_close(v, expected)


def test_svd_compression_keeps_the_smallest_rank_holding_the_energy():
    u, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))
    s = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    m = (u[:, :4] * s) @ v.T  # singular values 3, 2, 1, 0: energies 9/14, 13/14, 1
    assert svd_compress(m, 0.6)[0].shape[1] == 1
    assert svd_compress(m, 0.9)[0].shape[1] == 2
    parts = svd_compress(m, 0.99)
    assert parts[0].shape[1] == 3
    state = {"w": m.float(), "b": torch.ones(3)}
    back = decompress_state(compress_state(state, 0.99, "shared."), state, "shared.")
    torch.testing.assert_close(back["w"], m.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(back["b"], state["b"])
    # a float64 run's matrix travels in float64 (it went through float32: 1e-7 off), a bfloat16
    # one in float32 (LAPACK has no 16-bit SVD)
    exact = decompress_state(compress_state({"w": m}, 0.99, "shared."), {"w": m}, "shared.")["w"]
    assert exact.dtype == torch.float64
    torch.testing.assert_close(exact, m, atol=1e-13, rtol=0)
    assert svd_compress(m.bfloat16(), 0.99)[0].dtype == torch.float32


def test_a_non_finite_matrix_travels_uncompressed_to_the_divergence_check():
    """FedKD crashed (LAPACK: SVD did not converge) when a client's weights went NaN; the NaN must
    instead reach the federation's finiteness check, which applies the divergence policy."""
    m = torch.randn(5, 4)
    m[2, 1] = float("nan")
    assert len(svd_compress(m, 0.9)) == 1
    state = {"w": m, "b": torch.ones(3)}
    packed = compress_state(state, 0.9, "shared.")
    assert set(packed) == {"shared.w", "shared.b"}
    back = decompress_state(packed, state, "shared.")
    assert torch.equal(back["w"].isnan(), m.isnan())


def test_fedkd_uploads_compressed_shared_model_and_keeps_w_h_local():
    method, dm, x, y, uploads = _two_clients(FedKD)
    fit(method, dm, rounds=1)
    for u in uploads:
        assert set(u.groups) == {"shared"}  # the shared model only: W_h stays on the client
        assert any(k.endswith(".U") for k in u.group("shared"))  # matrices travel as SVD factors
    assert {c for c in method.client_states if method.client_state(c, "W_h.")} == {0, 1}  # the clients that trained
    w0, w1 = (method.client_state(c, "W_h.")["weight"] for c in (0, 1))
    assert not torch.equal(w0, w1)  # each client has its own W_h
