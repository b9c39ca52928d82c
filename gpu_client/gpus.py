"""What a GPU client offers: its GPUs through pynvml, or one CPU slot, as the ``Slot`` and
``SlotStats`` messages it registers and heartbeats with."""
from __future__ import annotations

import logging
import os

from zwdx.protocol.gpu import Slot, SlotStats
from zwdx.protocol.vocab import SlotKind

log = logging.getLogger(__name__)


def _nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:  # no driver, no library, no GPU
        log.debug("gpus: NVML unavailable: %s", exc)
        return None


def cpu_slot(index: int = 0) -> Slot:
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
        total, free = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    except OSError:
        total = free = 0
    return Slot(index=index, kind=SlotKind.CPU, name=f"CPU ({os.cpu_count()} cores)", memory_total=total,
                memory_free=free, utilization=None)


def discover(only: list[int] | None = None, cpu: bool = False, cpu_slots: int = 1) -> list[Slot]:
    """One slot per visible GPU (optionally only those indices), or ``cpu_slots`` CPU slots (they
    share the machine's cores and RAM)."""
    if cpu:
        return [cpu_slot(i) for i in range(cpu_slots)]
    nvml = _nvml()
    if nvml is None or nvml.nvmlDeviceGetCount() == 0:
        log.info("gpus: no NVIDIA GPU found; offering one CPU slot")
        return [cpu_slot()]
    slots = []
    for index in range(nvml.nvmlDeviceGetCount()):
        if only is not None and index not in only:
            continue
        slots.append(read(index, nvml))
    return slots


def read(index: int, nvml=None) -> Slot:
    nvml = nvml or _nvml()
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    name = nvml.nvmlDeviceGetName(handle)
    try:
        util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
    except Exception:
        util = None
    return Slot(index=index, kind=SlotKind.CUDA, name=name.decode() if isinstance(name, bytes) else name,
                memory_total=int(mem.total), memory_free=int(mem.free), utilization=util)


def stats(slots: list[Slot]) -> list[SlotStats]:
    """Fresh free memory and utilisation of the slots offered."""
    out = []
    for slot in slots:
        try:
            fresh = cpu_slot(slot.index) if slot.kind == SlotKind.CPU else read(slot.index)
        except Exception as exc:
            log.debug("gpus: cannot read GPU %s: %s", slot.index, exc)
            continue
        out.append(SlotStats(index=slot.index, memory_free=fresh.memory_free, utilization=fresh.utilization))
    return out


def utilization(index: int) -> float | None:
    try:
        return float(read(index).utilization)
    except Exception:
        return None
