"""Pooling models (vLLM's --runner pooling): embeddings, classifiers, cross-encoders, rerankers.

- `st_folder`: a model folder read as sentence-transformers reads it (Pooling, Dense, Normalize
  modules; prompts; a cross-encoder's activation);
- `resolve`: the runner and `PoolerConfig` from the flags, the folder and the architecture;
- `head`: what the runner's `Pooler` does with the pooled states (Dense + normalise, classifier);
- `outputs`: vLLM-shaped outputs and the front end's post-processing (activations, Matryoshka
  `dimensions`, cosine scores), shared by `LLM` and the HTTP endpoints;
- `inputs`: prompts (instructions), text pairs for scoring, truncation.
"""
