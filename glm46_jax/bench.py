"""`python -m glm46_jax.bench`: the command line of `glm46_jax.training.bench`."""

from glm46_jax.training.bench import run

if __name__ == "__main__":
    run()
