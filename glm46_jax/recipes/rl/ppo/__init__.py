"""PPO with a learned critic on the GLM-MoE model: the objective (per-token rewards, GAE, whitening, the clipped value loss, KL penalties, score normalisation)."""
