"""metrics.py: MFU arithmetic, the peak-FLOP/s table, the matmul probe, memory; sinks.py: the JSONL and TensorBoard
sinks behind the metric writer.

The TensorBoard check parses the event file's TFRecord framing and CRCs here, independently of
tensorboardX's writer (tensorboard's own reader is not a dependency).
"""

import dataclasses
import glob
import json
import math
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from glm46_jax.monitoring import metrics, sinks


@dataclasses.dataclass
class FakeDevice:
    device_kind: str


def test_mfu_hand_computed():
    assert metrics.mfu(1e9, 1000.0, 2, 1e12) == pytest.approx(0.5)
    # 6 * 1e8 params: 6e8 FLOPs/token at 5e4 tok/s on 8 chips of 989.4e12 -> 3e13 / 7.9152e15.
    assert metrics.mfu(6e8, 5e4, 8, 989.4e12) == pytest.approx(3e13 / 7.9152e15)


@pytest.mark.parametrize(("kind", "dtype", "expected"), [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "float32", 66.9e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "bfloat16", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),  # must not fall to the shorter "A10" key
    ("NVIDIA A100-SXM4-80GB", "float32", 19.5e12),
    ("NVIDIA A10G", "bfloat16", None),  # shadowed: not the A10's rate
    ("NVIDIA B200", "bfloat16", 2.25e15),
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5", "bfloat16", 459e12),  # v5p's device_kind
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5 lite", "float32", None),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("cpu", "float32", None),
    ("cpu", "bfloat16", None),
])
def test_peak_flops_table(kind, dtype, expected):
    assert metrics.peak_flops(FakeDevice(kind), dtype) == expected


def test_peak_flops_real_cpu_device_is_unknown():
    assert metrics.peak_flops(jax.devices()[0], "float32") is None


def test_measure_matmul_peak_sane_on_cpu():
    flops = metrics.measure_matmul_peak(sizes=(256,), repeats=2)
    assert math.isfinite(flops) and 1e8 < flops < 1e13


def test_device_memory_peak_bytes_cpu_is_positive_int():
    # Hold a 32 MiB array so the peak RSS is at least that, whatever else the process holds.
    x = jnp.ones((8 * 1024 * 1024,), jnp.float32).block_until_ready()
    peak = metrics.device_memory_peak_bytes()
    assert isinstance(peak, int) and peak >= x.nbytes


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli, reflected 0x82F63B78), rotated right 15, plus a constant."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_scalars(path: str) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in one TensorBoard event file, checking each record's CRCs."""
    with open(path, "rb") as f:
        data = f.read()
    scalars, offset = [], 0
    while offset < len(data):
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        assert length_crc == _masked_crc32c(header)
        record = data[offset + 12:offset + 12 + length]
        (record_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
        assert record_crc == _masked_crc32c(record)
        offset += 16 + length
        event = event_pb2.Event.FromString(record)
        scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    assert offset == len(data)
    return scalars


STEPS = {
    1: {"loss": 6.25, "lr": 1e-4, "mfu": np.float32(0.125)},
    2: {"loss": jnp.float32(3.5), "lr": 2e-4, "mfu": np.float64(0.25)},
    3: {"loss": 2.0, "lr": 3e-4, "mfu": 1},
}


def test_metric_writer_jsonl_and_tensorboard(tmp_path):
    run_dir = str(tmp_path / "run")
    with _writer(run_dir) as writer:
        for step, scalars in STEPS.items():
            writer.write(step, scalars)
        # Flushed on write: readable while the run goes, before close.
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            assert len(f.readlines()) == 3

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert lines == [
        {"step": 1, "loss": 6.25, "lr": 1e-4, "mfu": 0.125},
        {"step": 2, "loss": 3.5, "lr": 2e-4, "mfu": 0.25},
        {"step": 3, "loss": 2.0, "lr": 3e-4, "mfu": 1.0},
    ]

    (event_file,) = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))
    got = _read_scalars(event_file)
    want = [(step, tag, float(value)) for step, scalars in STEPS.items() for tag, value in scalars.items()]
    assert [(s, t) for s, t, _ in got] == [(s, t) for s, t, _ in want]
    for (_, _, got_value), (_, _, want_value) in zip(got, want, strict=True):
        assert got_value == pytest.approx(want_value, rel=1e-7)  # stored as float32


def test_metric_writer_non_finite(tmp_path):
    with _writer(str(tmp_path)) as writer:
        writer.write(7, {"loss": float("nan"), "grad_norm": np.inf, "ok": 1.5})
    with open(tmp_path / "metrics.jsonl") as f:
        text = f.read()
    assert json.loads(text) == {"step": 7, "loss": None, "grad_norm": None, "ok": 1.5}
    assert "NaN" not in text and "Infinity" not in text

    (event_file,) = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    values = {tag: value for _, tag, value in _read_scalars(event_file)}
    assert math.isnan(values["loss"]) and values["grad_norm"] == math.inf and values["ok"] == 1.5


def test_metric_writer_truncates_and_close_is_idempotent(tmp_path):
    with _writer(str(tmp_path), tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
        writer.write(2, {"loss": 2.0})
    writer.close()
    writer = _writer(str(tmp_path), tensorboard=False)
    writer.write(5, {"loss": 5.0})
    writer.close()
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line) for line in f] == [{"step": 5, "loss": 5.0}]
    assert not os.path.exists(tmp_path / "tensorboard")


def test_metric_writer_hands_every_sink_the_same_float_record():
    class Recording:
        def __init__(self):
            self.records, self.closed = [], 0

        def write(self, step, scalars, phase):
            self.records.append((step, dict(scalars), phase))

        def close(self):
            self.closed += 1

    a, b = Recording(), Recording()
    with sinks.MetricWriter([a, b]) as writer:
        writer.write(3, {"loss": jnp.float32(2.5), "n": np.int64(4)}, "code")
    assert a.records == b.records == [(3, {"loss": 2.5, "n": 4.0}, "code")]
    assert all(type(v) is float for v in a.records[0][1].values())
    assert a.closed == b.closed == 1


def _writer(run_dir: str, tensorboard: bool = True) -> sinks.MetricWriter:
    out = [sinks.JsonlSink(run_dir)]
    return sinks.MetricWriter(out + [sinks.TensorBoardSink(run_dir)] if tensorboard else out)
