"""`python -m glm46_jax.convert`: the command line of `glm46_jax.interop.convert`."""

from glm46_jax import cli
from glm46_jax.interop.convert import main

if __name__ == "__main__":
    cli.main_guard(main)
