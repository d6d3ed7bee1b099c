"""Personalised FL baselines (FedDr+ and FedSOL personalised tables): each client keeps or adapts its own model."""
