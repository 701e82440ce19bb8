"""The generic training driver every recipe plugs into:

    trainer      the loop every recipe runs (evaluation, bad steps, metrics, checkpoints, preemption)
    step         the train state of the named models and the one jitted update step
    compiled     compile once, barrier, cache: the train and eval steps, per segment and batch shape
    loss         cross-entropy, MTP, the sequence-balance aux loss, z-loss
    optim        clip -> Muon for hidden matrices, AdamW for the rest, under an lr schedule
    muon         Muon's update (Newton-Schulz orthogonalisation)
    offload      the optimizer state (and master weights) in host memory between steps (optim.offload)
    streamed     the offloaded update, one layer of each stack at a time
    balancing    loss-free load balancing and load statistics
    checkpoint   Orbax checkpoints: save, resume, start from another run's weights

What a run reports is `glm46_jax.monitoring`; what it trains, `glm46_jax.recipes`.
"""
