"""What a run trains, each a `training.trainer.Recipe`: pre-/mid-training, SFT, GRPO (registered in
`run_config.RECIPES`)."""
