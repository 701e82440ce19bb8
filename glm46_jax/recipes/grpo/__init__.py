"""Reinforcement learning with verifiable rewards (GRPO) on the GLM-MoE model (docs/rl.md).

    objective   group advantages (grpo / drgrpo / rloo), the clipped policy-gradient loss, KL estimate
    rewards     reward callables by name: exact numeric answer, think/answer format, code unit tests
    sandbox     the subprocess the code reward runs programs in (time, memory, no network, own directory)
    rollout     G samples per prompt from glm46_jax.infer.generate (log-probs, recorded routing) -> training rows
    curriculum  the prompt pool: difficulty buckets by measured pass rate, moving to harder ones
    step        the jitted GRPO update (with routing replay)
    recipe      the trainer.Recipe: rollouts, dynamic sampling, minibatches, held-out accuracy, checkpoints
"""
