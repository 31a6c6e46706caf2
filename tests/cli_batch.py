"""Several command lines of ``python -m lit_mpstable.app.train`` in one new process: Python, torch and Lightning are
imported once (~8 s) instead of once per command.

Each command runs as the console would run it: ``sys.argv`` set, ``main()`` called, the exit code taken from its
``SystemExit`` (an uncaught exception prints its traceback and gives 1, as the interpreter does), and file
descriptors 1 and 2 sent to files, so that everything the command writes (by Python, logging handlers made at
import, or C) is read back. The app is imported once, before the first command. Hydra's global state is cleared
between commands; the rest of the process's state (warning filters and once-only warnings, logging) carries over,
so a check that a warning is printed belongs in a process of its own.

    results = run_batch([[*overrides], ...], cwd=tmp_path)   # [{"code", "stdout", "stderr"}, ...]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path


def run_batch(commands: Sequence[Sequence[str]], cwd: Path, timeout: float = 600) -> list[dict]:
    results = Path(cwd) / "cli_batch_results.json"
    result = subprocess.run([sys.executable, __file__, json.dumps([list(c) for c in commands]), str(results)],
                            cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"the batch itself failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(results.read_text())


def _run_one(argv: list[str]) -> dict:
    from hydra.core.global_hydra import GlobalHydra

    from lit_mpstable.app import train

    GlobalHydra.instance().clear()
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["lit_mpstable.app.train", *argv]
        try:
            train.main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            libc.fflush(None)  # C's stdio buffers too, before the descriptors go back
            for fd, copy in ((1, saved[0]), (2, saved[1])):
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        return {"code": code, "stdout": out.read(), "stderr": err.read()}


if __name__ == "__main__":
    import lit_mpstable.app.train  # noqa: F401 - imported before the first command's output is captured

    Path(sys.argv[2]).write_text(json.dumps([_run_one(argv) for argv in json.loads(sys.argv[1])]))
