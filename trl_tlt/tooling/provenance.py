"""Where a recorded figure came from: the command line, commit, machine and seconds of the run that made it.

Stamped into every benchmark JSON (scripts/) and the demo's (docs/demo/demo.json).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time

import torch


_STARTED = time.perf_counter()  # the process's start, near enough: the scripts import this first thing


# The vector extensions that decide which kernels torch runs on a CPU (and so its float round-off): named in `machine`.
_VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "neon", "sve", "asimd")


def processor() -> str:
    """The CPU's model and its vector extensions (from /proc/cpuinfo on Linux; the platform's name elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and name in ("", platform.machine(), platform.processor()):
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    vector = [flag for flag in _VECTOR_FLAGS if flag in flags]
    return f"{name} ({' '.join(vector)})" if vector else name


def machine() -> str:
    """The machine a run was on: architecture, CPU model and vector extensions, cores, torch version and threads, and
    the GPU if torch has one."""
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    cores = os.cpu_count()
    return (
        f"{platform.machine()}, {processor()}, {cores} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads{gpu}"
    )


def commit() -> str:
    """The repository's commit (short), with "+dirty" when tracked files differ from it; "unknown" outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=here).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def command() -> str:
    """This process's command line as typed (`python -m ...` kept), the interpreter written `python`."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv[0] = "python"
    return shlex.join(argv)


def stamp(result: dict) -> dict:
    """`result` with `command`, `commit` (the code the run started with), `machine` and `seconds` (since the process
    started) added; values the run set itself are kept."""
    provenance = {
        "command": command(),
        "commit": _COMMIT,
        "machine": machine(),
        "seconds": round(time.perf_counter() - _STARTED, 1),
    }
    return {**provenance, **result}


_COMMIT = commit()  # at the start: files edited while a run goes on are not the code it runs
