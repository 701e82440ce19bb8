"""`python -m glm46_jax.generate`: the command line of `glm46_jax.infer.generate`."""

from glm46_jax import cli
from glm46_jax.infer.generate import main

if __name__ == "__main__":
    cli.main_guard(main)
