"""The notebooks run headless, top to bottom, without error (so they never rot)."""

import os

import compile_cache
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "notebooks")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")))
def test_notebook_executes(name, sample_corpus, monkeypatch):
    # The kernel inherits this environment: 8 CPU devices (conftest), the session's corpus and XLA cache.
    monkeypatch.setenv("GLM_DATA_ROOT", sample_corpus)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(compile_cache.MIN_COMPILE_S))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", os.environ["GLM46_JAX_TEST_XLA_CACHE"])
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
