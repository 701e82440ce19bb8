"""What a run trains: each recipe is a `training.trainer.Recipe`, registered by name in `run_config.RECIPES`, with
its config section beside it (docs/trainer.md#adding-a-recipe).

    base         RecipeBase (what every recipe shares) and LanguageModeling (next-token training on token batches)
    models       a recipe's named models, built one way: mesh -> weights -> adapters -> optimizers -> state
    pretrain     pre-training and mid-training: a curriculum of phases
    sft          supervised fine-tuning on chats (full or LoRA), and its `sft` section
    preference/  the reward model and DPO (IPO, SimPO) on preference pairs
    rl/          reinforcement learning: the shared RL machinery, GRPO and PPO
"""
