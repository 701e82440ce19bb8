"""`python -m glm46_jax.eval`: the command line of `glm46_jax.infer.eval`."""

from glm46_jax import cli
from glm46_jax.infer.eval import main

if __name__ == "__main__":
    cli.main_guard(main)
