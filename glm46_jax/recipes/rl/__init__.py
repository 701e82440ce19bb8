"""Reinforcement learning on the GLM-MoE model (docs/rl.md): the machinery GRPO and PPO share, and the two recipes.

    rollout       G samples per prompt from glm46_jax.infer.generate (log-probs, recorded routing) -> training rows
    rewards       reward callables by name: exact numeric answer, think/answer format, code unit tests
    sandbox       the subprocess the code reward runs programs in (time, memory, no network, own directory)
    curriculum    the prompt pool: difficulty buckets by measured pass rate, moving to harder ones
    reward_model  a trained reward model as a reward: rollouts scored on the run's mesh
    grpo/         group advantages, the clipped policy-gradient loss, the GRPO step and recipe
    ppo/          a critic, GAE and the value loss, the joint policy + critic step, the PPO recipe
"""
