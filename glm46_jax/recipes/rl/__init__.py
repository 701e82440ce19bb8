"""Reinforcement learning on the GLM-MoE model (docs/rl.md): the machinery GRPO and PPO share, and the two recipes.

    config        RLConfig, the `rl` section both recipes are handed
    base          RLRecipe, the shared recipe: the rollout loop, dynamic sampling, minibatches, reference log-probs,
                  held-out accuracy, the data state; the seams each recipe fills (its step and its advantages)
    build         what the recipes' builds share: the settings RL needs, the policy's spec, the KL reference, the
                  reward model(s) as a scorer
    prompts       the prompts files, their tokens, the tokenizer, the rewards: what every RL recipe reads
    rollout       G samples per prompt from glm46_jax.infer.generate (log-probs, recorded routing); trajectories ->
                  training rows (only sampled tokens trained)
    rewards       reward callables by name: exact numeric answer, think/answer format, code unit tests
    sandbox       the subprocess the code reward runs programs in (time, memory, no network, own directory)
    environments  tool environments for agentic RL: GLM's tool-call markup parsed, a registry, calculator, python,
                  lookup, none
    episodes      multi-turn tool-use episodes: turns, tool turns appended, budgets, the reward
    ahead         the rollout worker: rollouts sampled up to rl.rollouts_ahead rollouts ahead of training
    curriculum    the prompt pool: difficulty buckets by measured pass rate, moving to harder ones
    reward_model  a trained reward model as a reward: rollouts scored on the run's mesh
    labellers     who says which of two completions is better: a checker, a file of labels, a function
    policy_pairs  on-policy preference pairs: the policy's samples, paired and labelled
    check         the reward model's held-out check during RL: its verdicts against the labeller's
    check_curve   an RL run against a reward model in numbers and a PNG: accuracy before and after, the check
    heldout       heldout.json (held-out passes per problem, before and after) and the gain's paired error
    objective     the clipped policy-gradient loss and its aggregations, the k3 KL, the truncated importance weights
    logprobs      the policy's log-probs of sampled completions with routing replay (both updates, the KL reference)
    grpo/         group advantages, the GRPO update, the GRPO recipe
    ppo/          the critic's objective (GAE, the value loss), the joint policy + critic update, the PPO recipe
"""
