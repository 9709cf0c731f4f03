"""What the numbers were measured on: versions, commit, CPU, GPU, driver. Every external tool (git, lscpu,
nvidia-smi) is optional: when it is missing or fails, that line says so and the benchmark goes on."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

import torch_gradstats
from torch_gradstats.ops.op import OP_QUALNAME

from .workloads import GiB, fmt_bytes, last_level_cache_bytes


def _tool(args: list[str], cwd: Path | None = None) -> str:
    """stdout of a tool, stripped; "" if it is missing, fails or hangs."""
    try:
        done = subprocess.run(args, check=False, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def kernel_description(device: torch.device) -> str:
    key = "CUDA" if device.type == "cuda" else "CPU"
    if torch._C._dispatch_has_kernel_for_dispatch_key(OP_QUALNAME, key):
        ext: object = sys.modules.get("torch_gradstats._C")
        capability = getattr(ext, "cpu_capability", None)
        counting = getattr(ext, "cpu_histogram_counting", None)
        if key == "CPU" and capability is not None and counting is not None:
            # which instruction set, and which way of counting the exponent histogram (GFNI or not), ran
            return f"compiled CPU kernel ({capability()}; histogram: {counting()})"
        return f"compiled {key} kernel"
    return "pure-PyTorch fallback (not the fused kernel)"


def machine_description(device: torch.device) -> dict[str, str]:
    """Date, versions, the commit measured (source checkouts), kernel, CPU, cache, GPU and driver."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "torch_gradstats": torch_gradstats.__version__,
        "python": platform.python_version(),
        "compiled extension loaded": str(torch_gradstats.HAS_EXTENSION),
    }
    # TORCH_GRADSTATS_COMMIT names the commit when the tree measured is a copy whose .git is not its own.
    commit = os.environ.get("TORCH_GRADSTATS_COMMIT") or _tool(
        ["git", "describe", "--always", "--dirty", "--abbrev=10"], cwd=Path(__file__).resolve().parent
    )
    info["commit measured"] = commit or "unknown (not run from a git checkout)"
    if hasattr(os, "getloadavg"):
        info["load average at start"] = f"{os.getloadavg()[0]:.2f}"
    info["fused op kernel"] = kernel_description(device)
    lscpu = _tool(["lscpu"])
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
               platform.processor() or platform.machine())  # fmt: skip
    info["cpu"] = f"{cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"
    info["last-level cache"] = fmt_bytes(last_level_cache_bytes(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, {props.total_memory / GiB:.0f} GiB"
        info["cuda (torch build)"] = str(torch.version.cuda)
        driver = _tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = driver.splitlines()[0] if driver else "unknown (nvidia-smi unavailable)"
    return info
