"""FedSOL (Lee et al., CVPR 2024) and its variants: the proximal-projection ablation and FedSOL with
other methods' proximal objectives."""
