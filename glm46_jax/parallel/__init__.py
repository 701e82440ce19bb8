"""The mesh and how arrays lie on it:

    sharding      the device mesh, its axes and the one table of logical-axis rules
    distributed   multi-process start-up (`jax.distributed` under Slurm, from explicit settings, or not at all)

CPU host settings are `glm46_jax.host`; the per-device memory plan is `glm46_jax.plan`.
"""
