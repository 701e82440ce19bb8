"""Learning from preference pairs (docs/preferences.md): the reward model and DPO (IPO, SimPO).

    config     PreferenceConfig, the `preference` section both recipes are handed
    objective  DPO (sigmoid, label smoothing), IPO, SimPO and Bradley-Terry losses as pure functions
    step       the jitted steps: the reward model's Bradley-Terry step and DPO's, on packed pair batches
    recipe     the "reward" and "dpo" recipes of the generic trainer, full or LoRA
    agreement  how well a reward model orders labelled pairs: agreement and calibration per score margin
"""
