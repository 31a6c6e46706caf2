"""Small C loops for the CPU, built on first use with the machine's C compiler, cached by digest, loaded with ctypes.

A loop is a named C source (:func:`load`). It is built with the C compiler inductor would use (``$CC``, else
``cc``/``gcc``/``clang``), ``-O3 -march=native -ffp-contract=off`` (no fused multiply-add: the loops repeat torch's
roundings) and, when asked and the compiler has it, OpenMP, into inductor's cache folder, keyed by the source, the
compiler, the flags and this CPU's feature flags (a cache shared by machines of other kinds builds its own copy).
Without a compiler, or when the build fails, :func:`load` returns ``None`` and the caller keeps its torch path.
``LIT_MPSTABLE_NATIVE=0`` turns every loop off (:func:`enabled`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
"""The build's flags; :func:`load` drops ``-march=native`` for a compiler that refuses it."""


SWITCH = "LIT_MPSTABLE_NATIVE"
"""The environment variable that turns every C loop off when ``0`` (read at each use: a test may set it late)."""


def enabled() -> bool:
    """Whether C loops may be used: not with ``LIT_MPSTABLE_NATIVE=0``."""
    return os.environ.get(SWITCH, "1") != "0"


def compiler() -> str | None:
    """The C compiler to build with (``$CC``, else ``cc``, ``gcc``, ``clang``), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def load(name: str, source: str, cc: str | None, *, openmp: bool = False) -> ctypes.CDLL | None:
    """The C ``source`` built (or found in the cache) as ``<name>_<digest>.so`` and loaded, or None where ``cc`` is
    None or every build fails. With ``openmp``, a build with ``-fopenmp`` is tried first (Apple's clang has none);
    a compiler that does not know ``-march=native`` builds for the baseline ISA."""
    if cc is None:
        return None
    portable = tuple(flag for flag in FLAGS if flag != "-march=native")
    tries = ((FLAGS + ("-fopenmp",),) if openmp else ()) + (FLAGS, portable)
    for flags in tries:
        path = build(name, source, cc, flags)
        if path is not None:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def build(name: str, source: str, cc: str, flags: tuple[str, ...]) -> str | None:
    """The path of ``source`` built with ``cc`` and ``flags`` into the cache (built now if it is not there yet), or
    None where the build fails."""
    folder = os.path.join(cache_root(), "lit_mpstable_native")
    digest = hashlib.sha256("\0".join((source, cc, *flags, cpu_features())).encode()).hexdigest()[:20]
    path = os.path.join(folder, f"{name}_{digest}.so")
    if os.path.exists(path):
        return path
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            source_path = os.path.join(scratch, f"{name}.c")
            with open(source_path, "w") as f:
                f.write(source)
            built = os.path.join(scratch, f"{name}.so")
            done = subprocess.run([cc, *flags, source_path, "-o", built], capture_output=True, timeout=120,
                                  check=False)
            if done.returncode != 0:
                return None
            os.replace(built, path)  # atomic: concurrent ranks each build, one file stays
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def cache_root() -> str:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR`` where set), where the built loops are kept."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except ImportError:  # pragma: no cover - inductor ships with every torch this package supports
        return os.path.join(tempfile.gettempdir(), "lit_mpstable")


def cpu_features() -> str:
    """This CPU's feature flags: -march=native builds for this CPU, so the cache key tells machines apart that share
    a cache folder."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
