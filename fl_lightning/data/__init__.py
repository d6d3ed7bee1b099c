from fl_lightning.data.datamodule import FederatedDataModule, RoundPlan
from fl_lightning.data.datasets import DATASETS, DataSpec, load_dataset, register_dataset, spec_of

__all__ = ["FederatedDataModule", "RoundPlan", "DataSpec", "DATASETS", "register_dataset", "load_dataset", "spec_of"]
