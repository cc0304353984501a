"""Where a measurement ran: the device's name and the software versions a result depends on."""

from __future__ import annotations

import platform
import re

import torch


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device | None = None) -> str:
    device = device or default_device()
    if device.type == "cuda":
        return slug(torch.cuda.get_device_name(device))
    return slug("cpu-" + cpu_name())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def software() -> dict:
    """The versions a result depends on: torch, its CUDA and cuDNN (None without CUDA; torch's
    SDPA prefers cuDNN only with a new enough runtime cuDNN), and the peers' packages (None
    when not installed), without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "transformers": installed("transformers"), "deepspeed": installed("deepspeed"),
            "flash_attn": installed("flash_attn") or installed("flash-attn")}
