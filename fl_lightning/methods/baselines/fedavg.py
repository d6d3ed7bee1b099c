"""FedAvg (McMahan et al., 2017): local SGD on cross-entropy, sample-weighted averaging.

Every hook of `SharedModelMethod` is already FedAvg's; this class exists so configs and logs name it,
and declares that the vectorised engine can train it.
"""

from fl_lightning.methods.shared_model import SharedModelMethod


class FedAvg(SharedModelMethod):
    vectorized = True  # its local step is a loss on the shared model (--federation.engine vectorized)
    vectorized_padding = True  # mean cross-entropy
    vectorized_one_backward = True  # cross-entropy of the model's output: values only
