"""``train_cases.py`` with one rank that SIGKILLs itself right after a given optimizer step
(``tests/helpers/rank_kill.py``), so the launch dies mid-stage. Usage::

    torchrun --standalone --nproc_per_node N tests/helpers/kill_cases.py RANK STEP SPEC.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.rank_kill import arm  # noqa: E402
from tests.helpers.train_cases import main  # noqa: E402

arm(int(sys.argv[1]), int(sys.argv[2]))
main(sys.argv[3])
