"""Methods grouped by family (fedsol/, baselines/, frozen/, personalized/, hetero/), one method (or a
closely related pair) per file. The CLI takes any of these by class name (`--model FedSOL`)."""

from fl_lightning.methods.base import FederatedMethod, SharedModelMethod
from fl_lightning.methods.baselines.fedavg import FedAvg
from fl_lightning.methods.baselines.feddyn import FedDyn
from fl_lightning.methods.baselines.fedexp import FedExP
from fl_lightning.methods.baselines.fednova import FedNova
from fl_lightning.methods.baselines.fedntd import FedNTD
from fl_lightning.methods.baselines.fedprox import FedProx
from fl_lightning.methods.baselines.fedsam import FedASAM, FedSAM
from fl_lightning.methods.baselines.moon import MOON
from fl_lightning.methods.baselines.scaffold import SCAFFOLD
from fl_lightning.methods.fedsol.combined import FedSOLFedDyn, FedSOLMOON, FedSOLSCAFFOLD
from fl_lightning.methods.fedsol.fedsol import FedSOL, ProximalProjection
from fl_lightning.methods.frozen.fedbabu import FedBABU
from fl_lightning.methods.frozen.feddr_plus import DotRegression, FedDrPlus
from fl_lightning.methods.frozen.fedetf import FedETF
from fl_lightning.methods.frozen.fedgela import FedGELA
from fl_lightning.methods.frozen.spherefed import SphereFed
from fl_lightning.methods.hetero.base import HeteroMethod
from fl_lightning.methods.hetero.fedgen import FedGen
from fl_lightning.methods.hetero.fml_fedkd import FML, FedKD
from fl_lightning.methods.hetero.lgfedavg_fedgh import FedGH, LGFedAvg
from fl_lightning.methods.hetero.prototypes import FedORGP, FedProto, FedTGP
from fl_lightning.methods.personalized.ditto import Ditto
from fl_lightning.methods.personalized.fedper_fedrep import FedPer, FedRep
from fl_lightning.methods.personalized.knn_per import KNNPer, KNNPerModel
from fl_lightning.methods.personalized.perfedavg import PerFedAvg

__all__ = [
    "FederatedMethod", "SharedModelMethod", "FedAvg", "FedSOL", "ProximalProjection",
    # FedSOL with other methods' proximal objectives (FedSOL paper Table 4, "Combined")
    "FedSOLMOON", "FedSOLFedDyn", "FedSOLSCAFFOLD",
    # baselines of the FedSOL / FedCONST tables
    "FedProx", "SCAFFOLD", "FedNova", "FedDyn", "MOON", "FedNTD", "FedSAM", "FedASAM", "FedExP",
    # frozen classifiers (FedDr+ paper)
    "FedBABU", "DotRegression", "FedDrPlus", "FedETF", "FedGELA", "SphereFed",
    # model-heterogeneous (FedORGP paper)
    "HeteroMethod", "FedORGP", "FedProto", "FedTGP", "LGFedAvg", "FedGH", "FML", "FedKD", "FedGen",
    # 1-step personalised FL (FedDr+ / FedSOL personalised tables)
    "FedPer", "FedRep", "Ditto", "PerFedAvg", "KNNPer", "KNNPerModel",
]
