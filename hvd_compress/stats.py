"""Compression statistics: bytes before and after compression, per tensor and per step."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TensorStats:
    codec: str
    raw_bytes: int = 0    # gradient bytes in the last step
    sent_bytes: int = 0   # bytes of this rank's own payloads in the last step
    total_raw: int = 0
    total_sent: int = 0
    collective: str = ""  # the strategy the tensor travelled by (hvd_compress.collectives)
    wire_bytes: float = 0.0  # bytes this rank sent for it in the last step, by the cost model


class CompressionStats:
    def __init__(self) -> None:
        self.tensors: dict[str, TensorStats] = {}
        self.steps = 0
        self._step_raw = 0
        self._step_sent = 0
        self._step_wire = 0.0
        self.last_step_wire = 0.0  # bytes this rank sent in the last step, by the cost model
        self.last_step_raw = 0
        self.last_step_sent = 0
        self.total_raw = 0
        self.total_sent = 0

    def record(self, name: str, codec: str, raw_bytes: int, sent_bytes: int,
               collective: str = "", wire_bytes: float = 0.0) -> None:
        t = self.tensors.get(name)
        if t is None:
            t = self.tensors[name] = TensorStats(codec)
        t.codec = codec
        t.collective, t.wire_bytes = collective, wire_bytes
        self._step_wire += wire_bytes
        t.raw_bytes, t.sent_bytes = raw_bytes, sent_bytes
        t.total_raw += raw_bytes
        t.total_sent += sent_bytes
        self._step_raw += raw_bytes
        self._step_sent += sent_bytes

    def end_step(self) -> None:
        self.steps += 1
        self.last_step_raw, self.last_step_sent = self._step_raw, self._step_sent
        self.last_step_wire, self._step_wire = self._step_wire, 0.0
        self.total_raw += self._step_raw
        self.total_sent += self._step_sent
        self._step_raw = self._step_sent = 0

    @property
    def ratio(self) -> float:
        """Uncompressed bytes over sent bytes, over all steps so far."""
        return self.total_raw / self.total_sent if self.total_sent else 1.0

    def summary(self) -> dict:
        return {"steps": self.steps, "last_step_raw_bytes": self.last_step_raw,
                "last_step_sent_bytes": self.last_step_sent,
                "last_step_wire_bytes": self.last_step_wire, "total_raw_bytes": self.total_raw,
                "total_sent_bytes": self.total_sent, "ratio": self.ratio}


def report(stats: CompressionStats, spec: str, steps: int, codec_ns: int,
           compressing: bool = True) -> dict:
    """What the launcher prints and writes (`--stats`): bytes per step from each tensor's last
    step, the ratio, and the time spent in codec kernels. `steps` and `codec_ns` come from the
    frontend (TensorFlow counts steps in a variable: a traced step never returns to Python).
    `compressing` is False while a schedule has compression switched off."""
    tensors = {name: asdict(t) for name, t in stats.tensors.items()}
    raw = sum(t.raw_bytes for t in stats.tensors.values())
    sent = sum(t.sent_bytes if compressing else t.raw_bytes for t in stats.tensors.values())
    return {"spec": spec, "steps": steps, "raw_bytes_per_step": raw,
            "sent_bytes_per_step": sent, "ratio": raw / sent if sent else 1.0,
            "wire_bytes_per_step": sum(t.wire_bytes for t in stats.tensors.values()),
            "codec_ms": codec_ns / 1e6, "codec_ms_per_step": codec_ns / 1e6 / steps if steps else 0.0,
            "tensors": tensors}


def summary_line(api: str, rep: dict) -> str:
    """One line for the end of a run."""
    return (f"hvd_compress: {rep['spec']} via {api}: {rep['steps']} steps, "
            f"{_size(rep['raw_bytes_per_step'])} -> {_size(rep['sent_bytes_per_step'])} per step "
            f"(ratio {rep['ratio']:.1f}x), codec {rep['codec_ms']:.1f} ms "
            f"({rep['codec_ms_per_step']:.2f} ms/step)")


# TensorBoard scalar tags, the same for both frontends.
SCALARS = ("hvd_compress/raw_bytes", "hvd_compress/sent_bytes", "hvd_compress/ratio",
           "hvd_compress/codec_ms")


def _size(nbytes: float) -> str:
    if nbytes < 1000:
        return f"{nbytes:.0f} B"
    unit = "kB"
    for unit in ("kB", "MB", "GB"):
        nbytes /= 1000
        if nbytes < 1000:
            break
    return f"{nbytes:.2f} {unit}"
