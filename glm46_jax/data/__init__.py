"""Training data at run time, read from what `data_prep` writes.

    loader             Grain pipelines over the ArrayRecord corpus: domains -> mixture -> packed rows -> batches
    curriculum         training phases by token budget and the batch iterator over them
    iterator_state     Grain iterator state as JSON, carried across a pipeline rebuild
    packed_source      what the packed-sample loaders share: the config, the record source, the split, the batches
    sft_loader         SFT chat samples -> packed rows -> batches
    preference_loader  preference pairs -> packed rows -> batches
"""
