"""Test-wide setup: 8 virtual CPU devices, set before anything imports jax."""

import fcntl
import functools
import gc
import json
import os
import shutil
import subprocess
import tempfile

# LLVM at -O0 for XLA:CPU's generated code: most of the suite's time is XLA compiling hundreds of small programs,
# and at -O0 the whole suite took 2,000 s instead of 2,878-2,957 s on a 2-core box (2026-11-24; the tests that
# mostly execute, like the RL and SFT runs, get slower, but the total falls). It changes how fast the code runs,
# not what it computes (no fast-math either way). XLA_FLAGS that already name a level keep theirs.
flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import compile_cache
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm46_jax.parallel import sharding

# One persistent XLA cache per test run, shared by its workers (they inherit the directory from the process that
# starts them) and empty at the start: the same programs (the tiny model's init, forward and train step) compile in
# many test files and on both workers, and each file drops its executables (below), so a later file reads them back
# instead of compiling again. Per run, not per machine, so `make test` stays a cold measurement; `.ci/run` keeps one
# per machine instead (tests/compile_cache.py). The JAX processes tests start use it too (`subprocess_env`).
jax.config.update("jax_compilation_cache_dir", compile_cache.resolve(os.environ["XLA_FLAGS"]))
jax.config.update("jax_persistent_cache_min_compile_time_secs", compile_cache.MIN_COMPILE_S)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


# The tiny preset with one dense and one MoE layer (and its MTP layer), as flags of the training CLI: every kind of
# layer, parameter and state, with less to compile at every launch than tiny's three layers (each MoE layer of the
# tiny train step is ~5 CPU-s of XLA compile). For the tests of plumbing (processes, signals, restarts, Slurm), where
# the model's depth is not the point.
PLUMBING_MODEL = ("--config.model.num_hidden_layers=2",)


def subprocess_env(devices: int | None = 1, **extra: str) -> dict[str, str]:
    """The environment of a JAX process a test starts (the training CLI, the multi-process launcher): this run's XLA
    flags (-O0, as above) with `devices` virtual CPU devices (None: the caller sets the count, as
    launch/local_multiprocess.sh does per process), and this run's persistent compilation cache, so a later process
    with the same programs reads them instead of compiling (only process 0 of a multi-process job writes it)."""
    flags = [f for f in os.environ["XLA_FLAGS"].split() if "device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), "PYTHONPATH": ROOT,
            "JAX_COMPILATION_CACHE_DIR": os.environ["GLM46_JAX_TEST_XLA_CACHE"],
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(compile_cache.MIN_COMPILE_S), **extra}


def run_losses(run_dir: str) -> dict[int, float]:
    """train/loss per step in a run's metrics.jsonl, the last record per step (a resumed run logs again the steps after
    its checkpoint); {} before the file exists. Read while the run writes: a last line not yet ended by its newline is
    a record being written, left for the next read (parsing it failed test_resilience now and then)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = f.read().split("\n")[:-1]  # what follows the last newline is incomplete (or empty)
    return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}


# XLA:CPU code generation that computes the same numbers on every x86-64 host (tests/README.md#one-hosts-numbers):
# no YNNPACK fusions (YNNPACK picks its dot and reduction kernels, and with them the lanes a sum is split into, by the
# CPU it runs on: 16 floats on AVX-512, 8 on AVX2, whatever --xla_cpu_max_isa says), so XLA emits every operation
# itself, for one fixed ISA, at -O0 (no FMA contraction by LLVM, which at -O2 follows each program's fusions). A
# test that compares two different programs bit for bit compiles both with it: `jitted.lower(...).compile(PINNED)`.
PINNED_CODEGEN = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_max_isa": "AVX2",
                  "xla_backend_optimization_level": 0}


def assert_heldout_gain(runs: list[dict]) -> None:
    """The RL acceptance tests' claim on the heldout.json records of runs (seeds) from one starting policy: the mean
    held-out gain exceeds 2 of its paired standard errors (glm46_jax/recipes/rl/heldout.py) and no run loses more
    than one of its own."""
    from glm46_jax.recipes.rl import heldout

    g = heldout.gain(runs)
    seen = (g, [(r["start_accuracy"], r["end"]["accuracy"]) for r in runs])
    assert g.mean > 2 * g.se, seen
    assert all(mean > -se for mean, se in g.per_run), seen


@functools.cache
def jitted_apply(graphdef, **options):
    """`model.apply(graphdef, params, buffers, *args, **options, **kw)` jitted once per (graphdef, options) for the
    test process, so every shape is traced, lowered and compiled once: a helper that wraps `apply` in a new
    `jax.jit(lambda ...)` at every call does all three again each time, for shapes it has already compiled."""
    from glm46_jax.model import apply

    return jax.jit(lambda params, buffers, *args, **kw: apply(graphdef, params, buffers, *args, **options, **kw))


# The longest row a test's no-cache reference forward reads (prompt + generated tokens), see `prefix_forward`.
PREFIX_SLOTS = 32


def prefix_forward(graphdef, params, buffers, seq, **options):
    """The training forward (no cache) of one row `seq`, right-padded to PREFIX_SLOTS tokens: attention is causal and
    the MoE dropless, so its outputs at positions < len(seq) are those of `seq` alone, and a re-run-everything
    reference (a full forward per generated token) compiles one program instead of one per prefix length."""
    if len(seq) > PREFIX_SLOTS:
        raise ValueError(f"a row of {len(seq)} tokens: raise PREFIX_SLOTS ({PREFIX_SLOTS})")
    row = np.zeros((1, PREFIX_SLOTS), np.int32)
    row[0, :len(seq)] = seq
    return jitted_apply(graphdef, **options)(params, buffers, jnp.asarray(row))


def apply_flags(config, flags: list[str]):
    """A training CLI's `--config.a.b=value` flags applied to its ConfigDict in this process (the same run, in-process),
    each value converted to the type of the field it replaces (ints for fields that start out empty)."""
    for flag in flags:
        path, value = flag.removeprefix("--config.").split("=", 1)
        *parents, leaf = path.split(".")
        node = config
        for name in parents:
            node = node[name]
        node[leaf] = type(node[leaf])(value) if leaf in node and node[leaf] is not None else int(value)
    return config


# Every executable XLA:CPU compiles keeps memory mappings for its JIT code and data (~50 for the tiny model's
# forward) as long as jax's caches hold it, and a pytest worker compiles thousands: one test file alone reached
# 15,000 mappings. Past the kernel's vm.max_map_count (65,530 by default) the next mmap fails inside XLA and the
# worker dies with a segfault (seen in CI at the same test every run: compiling in test_speculative after ~400
# tests on that worker). So compiled executables are dropped after every test file, and mid-file when a file
# alone gets near the limit. Keeping them from file to file measured no faster: 392 -> 361 s on nine model files, but
# 531 -> 561 s on model, generate and pipeline files (one process each, 2026-11-27).
MAX_MAPPINGS = 30_000
HAS_PROC_MAPS = os.path.exists("/proc/self/maps")  # Linux; elsewhere only the per-file drop runs


def memory_mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def _drop_executables():
    jax.clear_caches()
    gc.collect()


# Python's cyclic collector scans every live object of its oldest generation, and a test process holds several
# hundred thousand (jaxprs, MLIR, compiled programs): its full collections took 4-6% of the test time (measured:
# tests/README.md). So the objects that exist once the tests are collected (the imported libraries) are frozen out of
# collection, and the young generation is collected every 10,000 allocations instead of 700. Memory still comes
# back: each test file ends with a full collection (above).
GC_THRESHOLDS = (10_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# The files that take longest (worker-seconds in a `make test` on a 2-core box, 2026-11-26), handed out first: xdist
# (--dist loadfile --no-loadscope-reorder, Makefile) gives whole files to workers in collection order, so a long file
# started last would end the run on one worker while the other idles. The rest keep pytest's order after these.
LONGEST_FIRST = ("test_rl.py", "test_context_parallel.py", "test_preference_recipes.py", "test_resilience.py",
                 "test_pipeline.py", "test_multiprocess.py", "test_slurm.py", "test_data_prep_executors.py", "test_sharding.py",
                 "test_generate.py", "test_lora.py", "test_sft.py", "test_prometheus_e2e.py",
                 "test_passkey.py", "test_lora_pipeline.py", "test_offload.py")  # the last three: 40-75 s alone


_COMPILE_COUNTS = compile_cache.counts()


def pytest_sessionfinish(session):
    _COMPILE_COUNTS.save()  # every process of the run, xdist workers included; the first one sums them up below


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    before = _COMPILE_COUNTS.compile_s()
    yield
    _COMPILE_COUNTS.per_test[item.nodeid] = _COMPILE_COUNTS.compile_s() - before


_DURATIONS = {"setup": 0.0, "call": 0.0, "teardown": 0.0}


def pytest_runtest_logreport(report):
    # In the process that reports (with xdist: the controller, which receives every worker's reports once).
    _DURATIONS[report.when] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    if not hasattr(config, "workerinput"):
        # The suite's CPU work as tests/README.md compares it between trees (on one machine): every test's setup +
        # call + teardown summed over the workers, what `--durations=0` lists.
        total = sum(_DURATIONS.values())
        terminalreporter.write_line(f"sum of test durations: {total:.1f} s (setup {_DURATIONS['setup']:.1f}, call "
                                    f"{_DURATIONS['call']:.1f}, teardown {_DURATIONS['teardown']:.1f})")
        for line in compile_cache.summary():
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order inside a file is kept


@pytest.fixture(scope="module", autouse=True)
def _fresh_executables_per_file():
    yield
    _drop_executables()


@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
    yield
    if HAS_PROC_MAPS and memory_mappings() > MAX_MAPPINGS:
        _drop_executables()


@pytest.fixture(scope="session")
def mesh1():
    """A one-device mesh: the single-device reference every sharded run is compared against."""
    return sharding.make_mesh({"data": 1}, jax.devices()[:1])


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory):
    """The `make train` corpus (`python -m data_prep sample`), capped small: code + prose domains,
    a 512-token byte-level BPE (pad 0, eos 1), train and heldout splits."""
    from data_prep import cli

    out = str(tmp_path_factory.mktemp("sample_corpus"))
    assert cli.main(["sample", "--out", out, "--max-docs-per-domain", "300"]) == 0
    return out


def init_placed(cfg, mesh, seed: int = 0):
    """`init_model(cfg, mesh, seed)` for tests about what runs on a mesh, not about init: the one-device init (one
    compiled program per config in a process, which the one-device reference compiles anyway) moved onto `mesh` in
    its layout, the MoE stack in pipeline slot order, as a checkpoint restore places weights. Compiling the init for
    each test mesh cost 2-6 s per mesh (test_pipeline + test_context_parallel alone: 330 -> 311 s). Init on a mesh
    itself is checked against one device in test_sharding (data x tensor x expert) and test_pipeline (pipeline
    stages, through a checkpoint)."""
    from flax import nnx

    from glm46_jax.model import abstract_model, init_model, pipeline

    _, params, buffers = init_model(cfg, sharding.make_mesh({"data": 1}, jax.devices()[:1]), seed)
    graphdef, *like = abstract_model(cfg, mesh)
    # As checkpoint.restore_model does: the values in layer order in the target's containers, then its layout. On the
    # host, so nothing is committed to the one device: jit and device_put place them on `mesh`.
    tree = jax.tree.map(lambda x: x, pipeline.layer_order_target(tuple(like), cfg))
    for container, values in zip(tree, (params, buffers), strict=True):
        nnx.replace_by_pure_dict(container, jax.tree.map(np.asarray, nnx.to_pure_dict(values)))
    placed = pipeline.in_slot_order(tree, cfg, like=tuple(like))
    put = [jax.device_put(x, a.sharding) for x, a in zip(jax.tree.leaves(placed), jax.tree.leaves(like), strict=True)]
    return graphdef, *jax.tree.unflatten(jax.tree.structure(tuple(like)), put)


def float64_nll(graphdef, params, buffers, mesh, batch):
    """Next-token NLL per position of a packed batch (NumPy arrays: inputs, positions, segment_ids, targets)
    in float64: the model's logits log-softmaxed in NumPy, the tests' reference for the CEs the code reports."""
    from glm46_jax.model import apply

    with sharding.use_mesh(mesh):
        logits = apply(graphdef, params, buffers, jax.numpy.asarray(batch["inputs"]),
                       jax.numpy.asarray(batch["positions"]), jax.numpy.asarray(batch["segment_ids"]),
                       with_mtp=False).logits
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1)[..., 0]


def randomize_params(params, seed=0, scale=0.3):
    """Weights moved by `scale` x N(0, 1) from init: logits far from uniform, so greedy choices have no near-ties."""
    keys = iter(jax.random.split(jax.random.key(seed), 200))
    return jax.tree.map(lambda p: p + scale * jax.random.normal(next(keys), p.shape, p.dtype), params)


def unavailable(why: str):
    """Skip, saying why, outside CI; in CI (.ci/run sets CI=true) the cluster, Ray or moto is part of the run, so
    fail."""
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


# Every test file that runs jobs on launch/local_slurm.sh's one cluster holds this lock shared (`slurm_env`); the
# test that stops and restarts the cluster takes it exclusively, so it never kills another xdist worker's jobs
# mid-run (it did: a data_prep Slurm run lost its running jobs to the restart and waited out their 10-minute limit).
# POSIX locks belong to the process: the exclusive request upgrades this worker's own shared lock and waits only for
# other workers'. One descriptor per process, because closing any descriptor of the file drops all of its locks.
@functools.cache
def cluster_lock_fd() -> int:
    return os.open(os.path.join(tempfile.gettempdir(), "glm46_slurm_tests.lock"), os.O_RDWR | os.O_CREAT, 0o666)


@pytest.fixture(scope="module")
def slurm_env():
    """The environment every Slurm command gets: the cluster's SLURM_CONF (launch/local_slurm.sh's unless set),
    with the cluster's lock held shared while the module runs. No cluster: skip, saying how to start one, except in
    CI, where the cluster is part of the run."""
    conf = os.environ.get("SLURM_CONF") or subprocess.run(
        ["bash", os.path.join(ROOT, "launch", "local_slurm.sh"), "conf"], capture_output=True, text=True,
        check=True).stdout.strip()
    env = {**os.environ, "SLURM_CONF": conf}
    try:
        answered = shutil.which("sinfo") and subprocess.run(["sinfo", "-h"], env=env, capture_output=True,
                                                            timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        answered = False
    if not answered:
        unavailable(f"no Slurm cluster answers sinfo (SLURM_CONF={conf}): start one with launch/local_slurm.sh "
                    "start (.ci/run does that before the tests)")
    fcntl.lockf(cluster_lock_fd(), fcntl.LOCK_SH)
    try:
        yield env
    finally:
        fcntl.lockf(cluster_lock_fd(), fcntl.LOCK_UN)
