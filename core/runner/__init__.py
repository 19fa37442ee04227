"""The model runner, in parts: `inputs` (request states, a step's input tensors), `kv_cache`
(checks, allocation, the capture context), `sampling` (the handoff from hidden states to tokens),
`pooler` (task embed) and `model_runner` (`ModelRunner`, which orchestrates them). `inputs` and
`kv_cache` are leaves: the public interface `portside.spec_decode.draft_model` builds on.
"""
