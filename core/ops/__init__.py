"""Pure-torch references of the kernels a platform may replace: the model-layer kernels of
`ModelOps` (`moe`, `lora`) and attention's layout-free math (`attention`). The contract's
defaults call them; they import the contract only to name its types."""
