"""`python -m glm46_jax.plan`: the command line of `glm46_jax.parallel.plan`."""

from glm46_jax import cli
from glm46_jax.parallel.plan import exit_code

if __name__ == "__main__":
    cli.main_guard(exit_code)
