"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path


def slug(text: str) -> str:
    """A name for result files: lower case, runs of anything but letters and digits as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_info() -> dict:
    """The first GPU: nvidia-smi's line for each, and what PyTorch says of device 0 (where both
    are there; errors recorded, not raised: a CPU run has neither)."""
    info: dict = {}
    if shutil.which("nvidia-smi"):
        q = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout.strip().splitlines()
            if out:
                info["nvidia_smi"] = out
                info["name"] = out[0].split(",")[0].strip()
        except (OSError, subprocess.SubprocessError) as exc:
            info["nvidia_smi_error"] = str(exc)
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(torch_name=p.name, sms=p.multi_processor_count, memory_bytes=p.total_memory,
                        capability=f"{p.major}.{p.minor}", torch=torch.__version__, cuda=torch.version.cuda)
            info.setdefault("name", p.name)
    except Exception as exc:  # no torch, or no device: not an error for a CPU dry run
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    return info


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device 0's device-to-device copy bandwidth in B/s (bytes read plus bytes written, the best of
    `reps` copies of `nbytes`, timed with CUDA events; PyTorch). Raises where there is no GPU."""
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * nbytes / best


def measured_bandwidth(timeout: float = 120) -> float:
    """copy_bandwidth() in a child process (whose CUDA context then goes away with it)."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--copy-bandwidth"], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1])
    return float(out.stdout.split()[-1])


if __name__ == "__main__" and sys.argv[1:] == ["--copy-bandwidth"]:
    print(copy_bandwidth())
