"""Speculative decoding: proposals for a request's next tokens, verified by one target forward.

`config.py` parses vLLM's `speculative_config`; `ngram.py` proposes from the request's own
tokens (prompt lookup); `draft_model.py` runs a smaller model with the target's vocabulary;
`backoff.py` pauses proposals for a request whose drafts keep failing. The scheduler schedules
each running request's last token plus its proposals, the model runner samples every one of
those positions as if the proposals before it were accepted, and the longest agreeing prefix
plus the target's next token come back (`runner.sampling.accepted_tokens`). The scheduler
imports only `config.py`, which is torch-free.
"""
