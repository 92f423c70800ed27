"""How much memory a rank may use here: the CUDA device's free memory, or the host's available memory.

Probing the machine is kept apart from :mod:`forge_lm.model.memory`, which estimates what a run
needs from its config alone: the estimate is arithmetic, testable anywhere; this module reads
``/proc``, cgroups and the CUDA driver.

- On CUDA, a rank may use its device's free memory (``torch.cuda.mem_get_info``).
- On the host, a rank may use the kernel's ``MemAvailable``, or a cgroup's remaining limit if
  lower (a container, a SLURM job), shared by the ranks on the host (``LOCAL_WORLD_SIZE``). This
  is the limit of a CPU run, and the host's share of a run with ``[distributed] cpu_offload``.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import torch


@attrs.frozen
class MemoryLimit:
    """The bytes a rank may use, and where that figure comes from (for messages)."""

    bytes: int
    source: str  # "of free memory on cuda:0 (NVIDIA H100)", "of available memory on this host"


def memory_limit(device: torch.device, *, processes_on_host: int = 1) -> MemoryLimit | None:
    """What one rank on ``device`` may use, or None when it cannot be told."""
    if device.type == "cuda":
        try:
            free, _total = torch.cuda.mem_get_info(device)
            name = torch.cuda.get_device_name(device)
        except Exception:  # noqa: BLE001 - no figure is better than a failed start
            return None
        return MemoryLimit(int(free), f"of free memory on {device} ({name})")
    if device.type == "cpu":
        return host_memory_limit(processes_on_host)
    return None


def host_memory_limit(processes_on_host: int = 1) -> MemoryLimit | None:
    """One rank's share of this host's available memory, or None when it cannot be told."""
    available = host_available_memory()
    if available is None:
        return None
    processes = max(1, processes_on_host)
    shared = f", shared by its {processes} processes" if processes > 1 else ""
    return MemoryLimit(available // processes, f"of available memory on this host{shared}")


def host_available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still allocate: the kernel's ``MemAvailable``, or less if a cgroup
    (a container, a SLURM job) limits it; ``sysconf`` where there is no ``/proc``."""
    found = []
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)  # kB
    except (OSError, ValueError, IndexError):
        pass
    groups = [cgroup]
    try:  # cgroup v2: this process's own group ("0::/slurm/job_1"), besides the namespace's root
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::/") and line[4:].strip():
                groups.insert(0, cgroup / line[4:].strip())
    except OSError:
        pass
    pairs = [(group / "memory.max", group / "memory.current") for group in groups]
    pairs.append((cgroup / "memory" / "memory.limit_in_bytes", cgroup / "memory" / "memory.usage_in_bytes"))  # v1
    for limit_file, usage_file in pairs:
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text().strip())
            if limit != "max" and int(limit) < 2**60:  # v1 writes a huge number for "no limit"
                found.append(max(0, int(limit) - usage))
        except (OSError, ValueError):
            pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):
            return None
    return min(found)


def processes_on_host(device: torch.device) -> int:
    """Ranks sharing this host's memory for a run on ``device``: torchrun's local world on CPU;
    each GPU is its own device (see :func:`ranks_on_host` for their shared host)."""
    if device.type != "cpu":
        return 1
    return ranks_on_host()


def ranks_on_host() -> int:
    """Ranks of this launch on this host (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
