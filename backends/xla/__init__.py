"""The xla backend (Google TPUs through torch-xla): static-shape paged attention (Pallas ragged
paged attention on TPU, a gather fallback elsewhere; sliding windows and logit softcaps),
dense static-shape mixture-of-experts, bucketed XLA precompilation, XLA collectives.

Registered through the `portside.platforms` entry point like any plugin. `register()` imports
nothing (in particular not torch_xla, whose import starts a runtime); `XlaPlatform.is_available()`
says why the platform cannot run here. ``PJRT_DEVICE=CPU`` runs it on torch-xla's CPU device,
for tests.
"""


def register() -> str:
    return "portside.backends.xla.platform:XlaPlatform"
