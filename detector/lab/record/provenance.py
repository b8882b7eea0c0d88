"""Where a document's figures came from, as every command that writes one names it: the machine (the device, its
host, torch and CUDA), the project's commit, the time and the command line.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from detector.config.device import device_name

ROOT = Path(__file__).resolve().parents[3]  # the project: the folder that holds detector/


def run_info(device: torch.device | str) -> dict:
    """What a result file records about the machine: device name, torch version (and CUDA's, on a GPU)."""
    info = {"device": device_name(device), "torch": torch.__version__}
    if torch.device(device).type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def run_header(device: torch.device | str) -> str:
    """One line naming the machine a run came from: ``NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0``."""
    info = run_info(device)
    return f"{info['device']}, torch {info['torch']}" + (f", CUDA {info['cuda']}" if "cuda" in info else "")


def host_cpu() -> str:
    """The host processor's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(device) -> str:
    """Device, host, torch, CUDA and the commit the figures came from."""
    info = f"**{device_name(device)}**, host {host_cpu()} ({os.cpu_count()} cores), "
    info += f"Python {platform.python_version()}, torch {torch.__version__}"
    if device.type == "cuda":
        info += f", CUDA {torch.version.cuda}"
    return info + f", commit {commit()}."


def commit(root: Path = ROOT) -> str:
    """The commit of the project's own checkout at ``root``, with ``+ uncommitted changes`` when the tree differs
    from it; ``$DETECTOR_COMMIT`` first where it is set (a copy of the tree on another machine may carry no .git).
    An unpacked copy of the project inside another repository is not a checkout: git would name that repository's
    commit, so the project's root must be the repository's."""
    given = os.environ.get("DETECTOR_COMMIT")
    if given:
        return f"{given} (a copy of its tree)"

    def git(*args):
        try:
            result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        except OSError:  # no git at all
            return ""
        return result.stdout.strip() if result.returncode == 0 else ""

    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != Path(root).resolve():
        return "unknown (not a git checkout)"
    head = git("rev-parse", "--short=10", "HEAD")
    if not head:
        return "unknown (a git checkout without a commit)"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=:,+-]+", arg) else f'"{arg}"'


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``: the report's file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
