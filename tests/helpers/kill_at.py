"""``embedpipe`` that SIGKILLs itself at a chosen point of the prepare stage (a real crash: no
cleanup, no exception handlers, no atexit). Before dying it writes the pids of its child
processes (the temporary Prefect server) to the file named by ``KILL_AT_CHILDREN``.

    python tests/helpers/kill_at.py POINT prepare --config ...

POINT: ``convert`` (after the first row is read), ``write`` (after the first output file is
staged: a table written whole, or a streamed table closed), ``commit`` (when the staged directory is about to replace the artifact).
"""

import os
import signal
import sys
from pathlib import Path

import embed_core.artifacts as artifacts
import embed_core.prepare.run as prepare_run
from flows.cli import main


def die() -> None:
    children = []
    for task in Path("/proc/self/task").iterdir():
        children += (task / "children").read_text().split()
    Path(os.environ["KILL_AT_CHILDREN"]).write_text(" ".join(children))
    os.kill(os.getpid(), signal.SIGKILL)


point = sys.argv[1]
if point == "convert":
    convert = prepare_run.convert_source

    def convert_then_die(*args, **kwargs):
        for item in convert(*args, **kwargs):
            yield item
            die()

    prepare_run.convert_source = convert_then_die
elif point == "write":
    write_table = artifacts.StageWriter.write_table

    def write_then_die(self, *args, **kwargs):
        write_table(self, *args, **kwargs)
        die()

    artifacts.StageWriter.write_table = write_then_die
    close_stream = artifacts.TableStream.close

    def close_then_die(self, *args, **kwargs):
        close_stream(self, *args, **kwargs)
        die()

    artifacts.TableStream.close = close_then_die
elif point == "commit":
    exchange = artifacts._exchange

    def die_before_exchange(a, b):
        die()

    artifacts._exchange = die_before_exchange
else:
    raise SystemExit(f"unknown point {point}")
sys.exit(main(sys.argv[2:]))
