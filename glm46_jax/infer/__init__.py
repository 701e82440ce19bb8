"""Running a trained model (its command lines, `python -m glm46_jax.generate` ..., are the top-level shims):

    load          weights from an HF directory or a training checkpoint, and the tokenizer beside them
    sampling      what every decoder shares: the result type, sampling from logits, checking and padding prompts
    generate      KV-cache generation: a jitted prefill, then a `lax.while_loop` decode
    speculative   speculative decoding with the MTP layer as the drafter
    score         per-token log-probabilities and the total log-likelihood of token sequences
    eval          held-out perplexity per domain of a corpus
    passkey       passkey retrieval accuracy per (context length, needle depth) cell (`eval --passkey`)
    harness       the lm-evaluation-harness adapter (model type `glm46_jax`)

The chat format they encode prompts with is `glm46_jax.interop.chat`.
"""
