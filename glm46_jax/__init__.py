"""glm46_jax: GLM-4.5 / GLM-4.6 Mixture-of-Experts training in JAX + Flax NNX.

Kept import-light on purpose: `import glm46_jax` must not pull in jax, so that the
multi-host launcher can set XLA flags and call `jax.distributed.initialize` first.
"""

__version__ = "0.1.0"
