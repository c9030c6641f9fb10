"""``--workers N``: N processes search one shape's study at once, one per GPU (or N on the CPU).

Each worker is a fresh process running the caller's ``command`` with the spec appended (the
tuner's: ``python -m autofuse.tuning.tuner SPEC``; not multiprocessing's spawn, which would re-run the
caller's ``__main__``), so this module needs nothing from the tuner above it. A worker searches
the shared study alone: no final choice, no table. It sees only its own GPU
(CUDA_VISIBLE_DEVICES), and samples with its own seed; ``autofuse.tuning.shared_study`` keeps the workers
from measuring a configuration twice. The invoking process shows the progress, then makes
the final choice on its own device. Workers on the CPU share its cores, so their timings are
noisier; the final re-timing runs alone. Each worker runs cores / N nvcc at once
($AUTOFUSE_BUILD_JOBS), so N workers compiling together do not oversubscribe the host N times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from autofuse.errors import InputError
from autofuse.kernels.build import build_jobs
from autofuse.serve.table import current_fingerprint, fingerprint_key
from autofuse.tuning.progress import TrialProgress
from autofuse.tuning.shared_study import measured

STOP_TIMEOUT_S = 15.0


def slots(workers: int, device: str) -> list[str]:
    """The CUDA_VISIBLE_DEVICES value of each worker ("" on the CPU: no GPU at all)."""
    if torch.device(device).type != "cuda":
        return [""] * workers
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()][:count] if visible is not None else [str(i) for i in range(count)]
    if workers > len(ids):
        raise InputError(f"--workers {workers} runs one worker per GPU, but {len(ids)} GPU(s) are visible here")
    target = fingerprint_key(current_fingerprint(device))
    for index in range(workers):
        found = fingerprint_key(current_fingerprint(f"cuda:{index}"))
        if found != target:
            raise InputError(f"worker {index} would run on GPU {ids[index]} ({found}), which differs from "
                             f"{device} ({target}): timings must come from one kind of GPU")
    return ids[:workers]


def search(spec: dict, workers: int, study, total: int, label: str, progress: bool, *, command: list[str]) -> None:
    """Run ``workers`` processes of ``command`` + [``spec`` as JSON] until all have ended; each
    worker's spec has its own seed and device and searches alone (``plan.workers`` = 1)."""
    settings = spec["settings"]
    device = "cuda" if torch.device(settings["device"]).type == "cuda" else "cpu"
    jobs = str(build_jobs() if "AUTOFUSE_BUILD_JOBS" in os.environ else max(1, build_jobs() // workers))  # the user's wins
    procs = []
    try:
        for index, slot in enumerate(slots(workers, settings["device"])):
            mine = {**spec, "settings": {**settings, "device": device, "seed": settings["seed"] + index},
                    "plan": {**spec["plan"], "workers": 1, "progress": False}}
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": slot, "AUTOFUSE_BUILD_JOBS": jobs}
            procs.append(subprocess.Popen([*command, json.dumps(mine)], env=env))
        _watch(procs, study, total, label, progress)
    finally:
        _stop(procs)
    failed = {index: proc.returncode for index, proc in enumerate(procs) if proc.returncode != 0}
    if failed:
        print(f"autofuse: search worker(s) {sorted(failed)} exited with code(s) {sorted(set(failed.values()))} "
              f"(their output is above); this process searches what they left", file=sys.stderr)


def _watch(procs, study, total: int, label: str, progress: bool) -> None:
    with TrialProgress(total, 0, label, enabled=progress) as bar:
        while any(proc.poll() is None for proc in procs):
            bar.show(measured(study))
            time.sleep(1.0)
        bar.show(measured(study))


def _stop(procs) -> None:
    """Interrupt workers still running (they fail their open trials on the way out), then kill."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
