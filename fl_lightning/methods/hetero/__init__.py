"""Model-heterogeneous methods (FedORGP paper): every client owns a model of its own architecture."""
