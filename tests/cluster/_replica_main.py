"""``kvcm serve`` for the cluster tests, able to say where it waits: ``SIGUSR1`` writes every
thread's stack (``faulthandler``) and every asyncio task's stack to stderr (the replica's log
file, see _cluster.py), so a test that times out can show where a replica was stuck."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import runpy
import signal
import sys
import time
from types import FrameType


def _dump_tasks(signum: int, frame: FrameType | None) -> None:
    """Runs on the main thread (the event loop's) between two bytecodes: the loop is not
    running a step, so its tasks can be walked."""
    out = io.StringIO()
    try:
        loop = asyncio.get_event_loop_policy().get_event_loop()
        tasks = asyncio.all_tasks(loop)
    except Exception as exc:  # no loop yet, or one being torn down
        print(f"--- asyncio tasks: none ({exc!r})", file=out)
        tasks = set()
    print(f"--- {len(tasks)} asyncio tasks at {time.time():.3f}", file=out)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"task {task.get_name()}: {task!r}"[:400], file=out)
        for frame in task.get_stack(limit=12):  # innermost last, as a traceback
            code = frame.f_code
            print(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}", file=out)
    print("--- end of tasks", file=out)
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _dump_tasks)
    sys.argv[0] = "kvcm"
    runpy.run_module("kvcm.server.cli", run_name="__main__", alter_sys=True)
