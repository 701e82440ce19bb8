"""`python -m glm46_jax.harness`: the command line of `glm46_jax.infer.harness`."""

from glm46_jax import cli
from glm46_jax.infer.harness import main

if __name__ == "__main__":
    cli.main_guard(main)
