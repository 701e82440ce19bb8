"""The generic training driver every recipe plugs into: the loop, the named models, the one update step, losses,
optimizers, loss-free balancing and checkpoints (what a run reports: `glm46_jax.monitoring`)."""
