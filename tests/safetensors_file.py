"""Read a safetensors file by its spec, float8 included (numpy's safetensors binding has no float8 dtype): the
quantized exports' tests (tests/test_quantize.py, tests/serving/)."""

import json
import struct

import ml_dtypes
import numpy as np


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """A safetensors file by its spec (an 8-byte header length, a JSON header, raw little-endian data): numpy's
    safetensors binding has no float8 dtype."""
    dtypes = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16, "I32": np.int32,
              "I64": np.int64}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return {name: np.frombuffer(data[s:e], dtypes[h["dtype"]]).reshape(h["shape"])
            for name, h in header.items() if name != "__metadata__" for s, e in [h["data_offsets"]]}
