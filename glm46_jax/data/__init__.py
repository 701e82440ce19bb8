"""Training data at run time: Grain loaders over the ArrayRecord corpus that `data_prep` writes
(`loader`), and the phase-by-phase curriculum over them (`curriculum`, `iterator_state`)."""
