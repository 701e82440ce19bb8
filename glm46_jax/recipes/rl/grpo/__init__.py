"""GRPO: the shared RL loop with group advantages in place of a critic (docs/rl.md).

    objective   group advantages (grpo / drgrpo / rloo)
    step        the jitted GRPO update (the shared clipped loss, the k3 KL, routing replay)
    recipe      the GRPO recipe: rl.base.RLRecipe with group advantages, dynamic sampling and the GRPO update
"""
