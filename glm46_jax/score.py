"""`python -m glm46_jax.score`: the command line of `glm46_jax.infer.score`."""

from glm46_jax import cli
from glm46_jax.infer.score import main

if __name__ == "__main__":
    cli.main_guard(main)
