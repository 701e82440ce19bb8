"""glm46_jax: GLM-4.5 / GLM-4.6 Mixture-of-Experts training in JAX + Flax NNX.

The packages, in the order imports flow (README "Layout"):

    recipes/     what a run trains: pretrain, sft, preference/ (reward model, DPO), rl/ (GRPO, PPO)
    training/    the generic driver every recipe plugs into: the loop, the one update step, losses, optimizers
    monitoring/  what a run reports: metric sinks, the Prometheus exporter, MFU, stragglers, the hang watchdog
    data/        training data at run time: the Grain loaders and the curriculum
    infer/       running a model: loading, sampling, generation, scoring, evaluation
    interop/     other formats: Hugging Face weights and chat templates, PEFT adapters, quantized exports
    model/       the GLM-MoE model, used functionally
    parallel/    the mesh and how arrays lie on it

and the top-level modules:

    train        `python -m glm46_jax.train`: config -> recipe -> resume or init -> trainer.fit -> summary
    rlhf         `python -m glm46_jax.rlhf`: RLHF in rounds (sample -> label -> reward model -> PPO) over train
    run_config   a run's typed config, converted once from the config file, and the recipe registry (RECIPES)
    plan, bench  the memory/FLOPs plan of a mesh; the real train step's tokens/s and MFU
    plan_search  the plan's layout search: the fewest devices and the mesh a step fits on
    generate, score, eval, harness, convert
                 the other command lines (`python -m glm46_jax.<name>`) over infer/ and interop/
    config       ModelConfig (HF Glm4MoeConfig field names), presets, config.json interop
    errors       InputError and the config checks every section and command line uses
    cli          what the command lines share: one-line user errors, flag parsing, byte sizes
    atomic       crash-safe file writes
    host         the CPU settings every command line applies before XLA starts

Kept import-light on purpose: `import glm46_jax` must not pull in jax, so that the
multi-host launcher can set XLA flags and call `jax.distributed.initialize` first.
"""

__version__ = "0.1.0"
