"""Pure-torch references of the model-layer kernels a platform may replace (`ModelOps`)."""
