"""Speculative decoding: proposals for a request's next tokens, verified by one target forward.

`config.py` parses vLLM's `speculative_config`; `ngram.py` proposes from the request's own
tokens (prompt lookup). The scheduler schedules each running request's last token plus its
proposals, the model runner samples every one of those positions as if the proposals before it
were accepted (`verify.py`), and the longest agreeing prefix plus the target's next token come
back. Torch-free: the scheduler imports this package.
"""
