"""Preference optimisation (issue 32, in progress): the objective so far; data, the reward model, the DPO and PPO
recipes come next (see the closing note of 2026-11-26).

    objective   DPO (sigmoid, label smoothing), IPO, SimPO and Bradley-Terry losses as pure functions
"""
