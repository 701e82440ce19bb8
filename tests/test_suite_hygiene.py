"""The test suite's own guard against XLA:CPU's memory mappings (tests/conftest.py): dropping jax's caches must
release the compiled executables' mappings, or long pytest workers segfault past vm.max_map_count."""

import jax
import jax.numpy as jnp
import pytest
from conftest import HAS_PROC_MAPS, _drop_executables

from glm46_jax.parallel import sharding
from glm46_jax.config import TINY
from glm46_jax.model import apply, init_model


def code_mappings() -> int:
    """This process's anonymous executable mappings: XLA:CPU's JIT code, one or more per executable. Counted apart
    from all mappings, which also move with thread stacks and allocator arenas: a worker's count once fell by 5
    while it compiled three programs, after the files before it had started and ended threads."""
    with open("/proc/self/maps") as f:
        fields = [line.split() for line in f]
    return sum(1 for x in fields if len(x) == 5 and "x" in x[1])


@pytest.mark.skipif(not HAS_PROC_MAPS, reason="counts /proc/self/maps (Linux)")
def test_dropping_caches_releases_compiled_executables(mesh1):
    with sharding.use_mesh(mesh1):
        graphdef, params, buffers = init_model(TINY, mesh1)

        def run_forward(length):
            forward = jax.jit(lambda p, x: apply(graphdef, p, buffers, x, jnp.arange(x.shape[1])[None],
                                                 jnp.ones_like(x)).logits)
            jax.block_until_ready(forward(params, jnp.ones((1, length), jnp.int32)))

        # A first forward brings up what the process keeps whatever it compiles (the compiler's threads and pools,
        # ~260 mappings): in a fresh process, counted from right after init, they came and went and the count fell.
        run_forward(3)
        _drop_executables()
        before = code_mappings()
        for s in (4, 5, 6):  # three executables of the tiny model's forward
            run_forward(s)
        grown = code_mappings() - before
        # What the guard is for: compiled code holds mappings (jaxlib 0.12: 2-3 per executable in a fresh process, one
        # of them its code, ~50 late in a test worker), and dropping the caches gives them back.
        assert grown >= 3, grown
        _drop_executables()
        assert code_mappings() - before < grown / 4, (before, grown, code_mappings())
