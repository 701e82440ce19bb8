"""PPO with a learned critic on the GLM-MoE model (docs/rl.md#ppo).

    config      PPOConfig, the `ppo` section (with `rl`) the recipe is handed
    objective   per-token rewards, GAE, whitening, the clipped value loss, KL penalties, score normalisation
    step        the jitted joint update of the policy and the critic
    recipe      the PPO recipe: rl.base.RLRecipe with a critic's advantages and the joint update
"""
