"""The test run's persistent XLA compilation cache: where it lives and how often it answered.

Per run by default: an empty directory that `make test` deletes when it ends, so a suite time stays a cold
measurement. With GLM46_JAX_XLA_CACHE_ROOT set (`.ci/run` sets it), one directory per jax/jaxlib version and XLA
flags under that root, kept between runs: a second CI run on the same machine reads what the first compiled.
Neither changes a result: JAX's own cache key covers the program, the compile options and the flags, and a hit is
the executable the same compile would have produced.
"""

import atexit
import hashlib
import json
import os
import shutil
import tempfile

DIR_ENV = "GLM46_JAX_TEST_XLA_CACHE"  # the directory this run uses; set once, inherited by workers and subprocesses
ROOT_ENV = "GLM46_JAX_XLA_CACHE_ROOT"  # the machine-level cache's root, if any
STATS_ENV = "GLM46_JAX_TEST_XLA_STATS"  # where each test process leaves its compile-request counts
REQUESTS, HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"
# jax_persistent_cache_min_compile_time_secs (conftest): faster programs are not written; reading one back took longer
# than compiling it (65 such hits saved -2.9 s in two model files, 2026-11-27).
MIN_COMPILE_S = 0.2
# Where the test processes' JAX time goes besides running programs (tests/README.md's breakdown).
STAGES = {"tracing": "/jax/core/compile/jaxpr_trace_duration",
          "lowering": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "XLA compile": "/jax/core/compile/backend_compile_duration"}  # the cache's reads included


def key(xla_flags: str) -> str:
    """The machine-level cache's subdirectory name: the jax and jaxlib versions and the XLA flags in one hash."""
    import jax
    import jaxlib

    text = f"jax {jax.__version__} jaxlib {jaxlib.__version__} XLA_FLAGS {' '.join(sorted(xla_flags.split()))}"
    return f"jax{jax.__version__}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def resolve(xla_flags: str) -> str:
    """Sets (once per run) and returns this run's cache directory; the first process of the run decides."""
    if DIR_ENV not in os.environ:
        root = os.environ.get(ROOT_ENV)
        if root:
            path = os.path.join(os.path.expanduser(root), key(xla_flags))
            os.makedirs(path, exist_ok=True)
        else:
            path = tempfile.mkdtemp(prefix="glm46_jax_test_xla_")
            atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ[DIR_ENV] = path
    if STATS_ENV not in os.environ:
        os.environ[STATS_ENV] = tempfile.mkdtemp(prefix="glm46_jax_test_xla_stats_")
        atexit.register(shutil.rmtree, os.environ[STATS_ENV], ignore_errors=True)
    return os.environ[DIR_ENV]


class Counts:
    """This process's compile requests that went through the persistent cache, and how many it answered."""

    def __init__(self):
        import jax

        self.requests = self.hits = self.written = 0
        self._hit = False
        self.saved_s = 0.0
        self.stages = dict.fromkeys(STAGES, 0.0)
        self.per_test: dict[str, float] = {}  # nodeid -> seconds tracing, lowering and compiling in it
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **_):
        if event == REQUESTS:
            self.requests += 1
            self._hit = False
        elif event == HITS:
            self.hits += 1
            self._hit = True

    def _on_duration(self, event: str, duration: float, **_):
        if event == SAVED:
            self.saved_s += duration
        for stage, name in STAGES.items():
            if event == name:
                self.stages[stage] += duration
        if event == STAGES["XLA compile"]:  # one per compile request, after its REQUESTS (and HITS) event
            # A miss that compiled for at least the threshold was written: a program the cache can answer next time.
            self.written += not self._hit and duration >= MIN_COMPILE_S

    def compile_s(self) -> float:
        return sum(self.stages.values())

    def save(self):
        with open(os.path.join(os.environ[STATS_ENV], f"{os.getpid()}.json"), "w") as f:
            json.dump({"requests": self.requests, "hits": self.hits, "saved_s": self.saved_s, "written": self.written,
                       "stages": self.stages, "per_test": self.per_test}, f)


_COUNTS: list[Counts] = []


def counts() -> Counts:
    """This process's one `Counts` (conftest may be imported under two names: as `conftest` and `tests.conftest`)."""
    if not _COUNTS:
        _COUNTS.append(Counts())
    return _COUNTS[0]


def summary() -> list[str]:
    """Two lines over every test process of this run (pytest and its xdist workers; not the JAX subprocesses tests
    start, which use the same cache directory): the cache's hit rate, and the time spent compiling."""
    requests = hits = saved_s = written = 0
    stages = dict.fromkeys(STAGES, 0.0)
    per_test: dict[str, float] = {}
    for name in os.listdir(os.environ[STATS_ENV]):
        with open(os.path.join(os.environ[STATS_ENV], name)) as f:
            counts = json.load(f)
        requests, hits, saved_s = requests + counts["requests"], hits + counts["hits"], saved_s + counts["saved_s"]
        written += counts["written"]
        stages = {k: v + counts["stages"][k] for k, v in stages.items()}
        per_test.update(counts["per_test"])
    kind = "machine-level" if os.environ.get(ROOT_ENV) else "per-run"
    # The rate counts the programs the cache keeps (compiled in >= MIN_COMPILE_S): hits / (hits + misses written).
    rate = f"{100 * hits / (hits + written):.1f}%" if hits + written else "n/a"
    cache = (f"XLA compile cache ({kind}, {os.environ[DIR_ENV]}): hit rate {rate}: {hits} read from it, {written} "
             f"compiled and written, {saved_s:.0f} s of compiling saved ({requests} compile requests, most too fast "
             "to cache), in the test processes")
    work = ("JAX compile work in the test processes: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
            + f" ({requests} programs, the cache's reads included)")
    top = [(t, s) for t, s in sorted(per_test.items(), key=lambda x: -x[1])[:10] if s >= 1]
    if top:
        work += "; most in a test (its fixtures' setup included): " + ", ".join(f"{t} {s:.0f} s" for t, s in top)
    return [cache, work]
