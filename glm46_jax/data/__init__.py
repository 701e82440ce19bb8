"""Training data. For now only the offline byte-level stdlib-docstring corpus (`bytes_corpus`);
the Grain/ArrayRecord pipeline replaces it in a later issue."""
