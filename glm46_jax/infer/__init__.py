"""Running a model: loading it, sampling, generation (plain and MTP-speculative), scoring, held-out eval, the
lm-eval harness adapter and the GLM chat format."""
