"""Baselines of the FedSOL and FedCONST tables, each in one file, all on the shared global model."""
