"""Offline data preparation for glm46_jax: raw text -> clean, filtered, deduplicated, tokenized ArrayRecord shards.

Stages (one module each, data flowing left to right):

    inputs -> clean -> quality -> dedup (minhash) -> tokenizer -> shards,   chained by `pipeline`

    documents, slices, steps   what the readers yield, which bytes each task reads, the first stage's blocks
    executors, work, peak      running the stages (local, Slurm, Ray), the run's work folder, peak memory per task
    report                     statistics and the run summary
    sft, preferences           chat (SFT) and preference-pair data: JSONL -> token ids with loss masks
    rl_tasks                   the RL demo's verifiable task, generated offline
    agent_tasks                the agentic RL demo's tasks: products for the calculator, a document store to look up
    passkey                    synthetic passkey retrieval cases (a context length x needle depth grid), offline
    sample, sample_chats, sample_preferences   the embedded sample corpus, chats and preference pairs
    policy_preferences         preference pairs from a policy's own samples, labelled (`policy-preferences`)
    cli                        `python -m data_prep COMMAND`

`python -m data_prep --help` lists the commands; README.md documents the output contract that
the training loader reads. Nothing here imports jax, except `policy-preferences`, which samples a model.
"""
