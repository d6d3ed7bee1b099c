"""Methods, one family per file. The CLI takes any of these by class name (`--model FedSOL`)."""

from fl_lightning.methods.base import FederatedMethod, SharedModelMethod
from fl_lightning.methods.ditto import Ditto
from fl_lightning.methods.fedavg import FedAvg
from fl_lightning.methods.fedbabu import FedBABU
from fl_lightning.methods.feddr_plus import DotRegression, FedDrPlus
from fl_lightning.methods.feddyn import FedDyn
from fl_lightning.methods.fedetf import FedETF
from fl_lightning.methods.fedexp import FedExP
from fl_lightning.methods.fedgela import FedGELA
from fl_lightning.methods.fedgen import FedGen
from fl_lightning.methods.fednova import FedNova
from fl_lightning.methods.fedntd import FedNTD
from fl_lightning.methods.fedprox import FedProx
from fl_lightning.methods.fedsam import FedASAM, FedSAM
from fl_lightning.methods.fedsol import FedSOL, ProximalProjection
from fl_lightning.methods.fedsol_combined import FedSOLFedDyn, FedSOLMOON, FedSOLSCAFFOLD
from fl_lightning.methods.hetero_base import HeteroMethod
from fl_lightning.methods.knn_per import KNNPer, KNNPerModel
from fl_lightning.methods.moon import MOON
from fl_lightning.methods.mutual import FML, FedKD
from fl_lightning.methods.perfedavg import PerFedAvg
from fl_lightning.methods.personal_head import FedPer, FedRep
from fl_lightning.methods.prototypes import FedORGP, FedProto, FedTGP
from fl_lightning.methods.scaffold import SCAFFOLD
from fl_lightning.methods.shared_head import FedGH, LGFedAvg
from fl_lightning.methods.spherefed import SphereFed

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
