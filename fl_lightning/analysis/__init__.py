"""Analyses of federated training: Hessian spectrum, loss surfaces, client divergence, partition
(one idea per module; `callback.AnalysisCallback` runs them as `--analysis.*`)."""
