"""``embedpipe`` under a launcher, with one rank that SIGKILLs itself right after a given optimizer
step (``tests/helpers/rank_kill.py``). Usage, as the launcher's script:

    torchrun --standalone --nproc_per_node 2 tests/helpers/launch_with_kill.py RANK STEP train --config ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flows.cli import main  # noqa: E402
from tests.helpers.rank_kill import arm  # noqa: E402

arm(int(sys.argv[1]), int(sys.argv[2]))
sys.exit(main(sys.argv[3:]))
