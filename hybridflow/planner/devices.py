"""Device specs as data: peaks, memory, links and efficiency factors, read from `devices.yaml`.

The cost model never hard-codes a device; it reads a `DeviceSpec`. The file is meant to be edited (a new
GPU is one block of YAML), so every key is checked on load and a bad one is a `ConfigError` naming
`device.key`. `--calibrate` replaces the efficiency factors with fitted ones (`with_efficiency`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from hybridflow.errors import ConfigError
from hybridflow.common import nearest_name

DEVICES_FILE = Path(__file__).with_name("devices.yaml")
EFFICIENCY_KINDS = ("gemm", "attention", "decode", "comm")
_NUMBERS = ("peak_tflops", "memory_gib", "memory_gbps", "intra_gbps", "inter_gbps", "link_latency_us",
            "layer_overhead_us")
GIB = 1024 ** 3


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU core) as the cost model sees it; SI units inside (FLOP/s, bytes, bytes/s, s)."""

    key: str
    name: str
    peak_flops: float
    memory_bytes: float
    memory_bw: float
    intra_bw: float
    inter_bw: float
    link_latency: float
    devices_per_node: int
    layer_overhead: float
    efficiency: dict[str, float]
    # Each device's share of its matrix-product throughput while every device of its node runs training or
    # forward passes at once: 1 for accelerators; below 1 for CPU processes that share the cores' arithmetic
    # (or their memory bandwidth). `calibrate.fit` measures it from one process against two.
    compute_share: float = 1.0

    def busy_factor(self, busy: int) -> float:
        """Speed of each of `busy` devices of one node running passes at once, over one running alone: 1 alone,
        `compute_share` with the whole node busy, its slowdown linear in the devices added between."""
        busy = min(busy, self.devices_per_node)
        if busy <= 1 or self.compute_share >= 1:
            return 1.0
        return 1.0 / (1.0 + (busy - 1) / (self.devices_per_node - 1) * (1.0 / self.compute_share - 1.0))

    def with_efficiency(self, **factors: float) -> "DeviceSpec":
        """This spec with some efficiency factors (or `layer_overhead`, seconds) replaced."""
        overhead = factors.pop("layer_overhead", self.layer_overhead)
        share = factors.pop("compute_share", self.compute_share)
        unknown = sorted(set(factors) - set(EFFICIENCY_KINDS))
        if unknown:
            raise ValueError(f"unknown efficiency kinds {unknown}; kinds are {list(EFFICIENCY_KINDS)}")
        return dataclasses.replace(self, efficiency={**self.efficiency, **factors}, layer_overhead=overhead,
                                   compute_share=share)

    def describe(self) -> str:
        eff = ", ".join(f"{k} {v:.3g}" for k, v in self.efficiency.items())
        return (f"{self.name}: {self.peak_flops / 1e12:g} TFLOP/s peak, {self.memory_bytes / GIB:g} GiB, "
                f"{self.memory_bw / 1e9:g} GB/s memory, links {self.intra_bw / 1e9:g} / {self.inter_bw / 1e9:g} "
                f"GB/s (in / between nodes of {self.devices_per_node}); efficiency {eff}; "
                f"{self.layer_overhead * 1e6:.3g} us per layer call"
                + (f"; {self.compute_share:.2f} of a device's compute each with its node busy"
                   if self.compute_share < 1 else ""))


def _number(entry: dict, key: str, where: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where}.{key}", f"must be a positive number, got {value!r}")
    return float(value)


def parse_device(key: str, entry: object, where: str = "") -> DeviceSpec:
    """A `DeviceSpec` from one YAML block; ConfigError naming the key for anything missing or wrong."""
    where = where or key
    if not isinstance(entry, dict):
        raise ConfigError(where, f"must be a mapping of device figures, got {type(entry).__name__}")
    known = {*_NUMBERS, "name", "devices_per_node", "efficiency", "compute_share"}
    for name in entry:
        if name not in known:
            hint = nearest_name(str(name), known)
            raise ConfigError(f"{where}.{name}", "unknown key" + (f" (did you mean '{hint}'?)" if hint else ""))
    n = {k: _number(entry, k, where) for k in _NUMBERS}
    per_node = entry.get("devices_per_node")
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ConfigError(f"{where}.devices_per_node", f"must be a positive integer, got {per_node!r}")
    eff = entry.get("efficiency")
    if not isinstance(eff, dict) or sorted(eff) != sorted(EFFICIENCY_KINDS):
        raise ConfigError(f"{where}.efficiency", f"must give exactly {list(EFFICIENCY_KINDS)}, got {eff!r}")
    factors = {k: _number(eff, k, f"{where}.efficiency") for k in EFFICIENCY_KINDS}
    for k, v in factors.items():
        if v > 1:
            raise ConfigError(f"{where}.efficiency.{k}", f"is a fraction of the peak, at most 1; got {v}")
    share = entry.get("compute_share", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError(f"{where}.compute_share", f"must be a fraction in (0, 1], got {share!r}")
    return DeviceSpec(compute_share=float(share), key=key, name=str(entry.get("name", key)), peak_flops=n["peak_tflops"] * 1e12,
                      memory_bytes=n["memory_gib"] * GIB, memory_bw=n["memory_gbps"] * 1e9,
                      intra_bw=n["intra_gbps"] * 1e9, inter_bw=n["inter_gbps"] * 1e9,
                      link_latency=n["link_latency_us"] * 1e-6, devices_per_node=per_node,
                      layer_overhead=n["layer_overhead_us"] * 1e-6, efficiency=factors)


def load_devices(path: Optional[str | Path] = None) -> dict[str, DeviceSpec]:
    """Every spec in the devices file (the packaged `devices.yaml` by default)."""
    path = Path(path) if path is not None else DEVICES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"device specs file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError("", f"{path} must map device names to their figures")
    return {str(k): parse_device(str(k), v) for k, v in data.items()}


def get_device(key: str, path: Optional[str | Path] = None) -> DeviceSpec:
    """The spec named `key` (case-insensitive), or a ConfigError naming the nearest known device."""
    devices = load_devices(path)
    if key.lower() not in devices:
        hint = nearest_name(key.lower(), devices)
        raise ConfigError("--device", f"unknown device {key!r}; known: {sorted(devices)}"
                          + (f" (did you mean '{hint}'?)" if hint else ""))
    return devices[key.lower()]
