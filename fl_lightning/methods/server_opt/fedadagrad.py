"""FedAdagrad (Reddi et al., ICLR 2021): Adagrad on the server, v_t = v_{t-1} + Delta_t^2 (the
second moment only grows, so the server's step shrinks where updates have been large)."""

from __future__ import annotations

from fl_lightning.methods.server_opt.adaptive import AdaptiveServerMethod


class FedAdagrad(AdaptiveServerMethod):
    """FedAdagrad (Reddi et al., ICLR 2021): an Adagrad server step on the average client update.

    Defaults: server_lr 10^-1.5, tau 10^-2, beta1 0, all from the authors' own tuning (hyperparameter
    notes in google-research/federated, optimization/docs/hyperparameters.md). They ran FedAdagrad
    as Keras Adagrad, which has no momentum (beta1 0), and tuned eta and tau per task on a log10
    grid: the best eta ranged from 10^-1.5 (EMNIST autoencoder, Stack Overflow next-word
    prediction) to 10 and the best tau from 10^-4 to 10^-1, 10^-2 on three of the six tasks
    (CIFAR-100, EMNIST character recognition, Stack Overflow tag prediction). Flower's FedAdagrad
    ships eta 0.1, no momentum and tau 1e-9; FL-bench's FedOpt ships server lr 0.1, beta1 0.9 and
    tau 1e-3; both start v at 0.

    Why the smallest eta of that range: without momentum, the first step moves a coordinate by
    eta * Delta / (sqrt(tau^2 + Delta^2) + tau), up to eta / (2 tau) times its average update
    Delta (for |Delta| well below tau) and close to eta itself for |Delta| well above tau. With
    clients that train several epochs with momentum (the demo setting,
    configs/settings/mnist5k.yaml), eta 0.1 with tau 1e-3 or 1e-2 (up to 50 or 5 times the
    update), or eta 10^-1.5 with tau 1e-3 (up to 16 times), throws the FedAvg CNN to a constant
    prediction and the run stays at chance. eta 10^-1.5 with tau 10^-2 (up to 1.6 times) trains as
    FedAvg does or better (docs/reference/method-defaults.md); beta1 0.9, which Algorithm 2 allows,
    also trains there with eta 0.1.

    Args:
        server_lr: the server's step size eta (tuned per task by the paper).
        beta1: momentum of the pseudo-gradient (0: Adagrad has none, as the Keras Adagrad behind
            the paper's experiments; Algorithm 2 allows any).
        tau: adaptivity: the second moment's floor tau^2 and the step's denominator term.
        beta2: see AdaptiveServerMethod (not used: v only grows).
    """

    def __init__(self, server_lr: float = 10**-1.5, beta1: float = 0.0, tau: float = 1e-2, **kwargs):
        super().__init__(server_lr=server_lr, beta1=beta1, tau=tau, **kwargs)

    def second_moment(self, v, delta_sq):
        return v + delta_sq
