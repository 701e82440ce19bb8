"""Offline data preparation for glm46_jax: raw text -> clean, filtered, deduplicated, tokenized ArrayRecord shards.

Stages (one module each, data flowing left to right):

    inputs -> clean -> quality -> dedup (minhash) -> tokenizer -> shards,   chained by `pipeline`

`python -m data_prep --help` lists the commands; README.md documents the output contract that
the training loader reads. Nothing here imports jax.
"""
