"""GRPO: reinforcement learning with group advantages on the GLM-MoE model (docs/rl.md).

    objective   group advantages (grpo / drgrpo / rloo), the clipped policy-gradient loss, KL estimate
    step        the jitted GRPO update (with routing replay)
    recipe      the trainer.Recipe: rollouts, dynamic sampling, minibatches, held-out accuracy, checkpoints
"""
