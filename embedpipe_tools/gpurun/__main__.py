"""``python -m embedpipe_tools.gpurun [--cpu] [--out DIR] [--budget-s S] [--max-rows N]`` (see the package docstring)."""

from embedpipe_tools.gpurun import main

raise SystemExit(main())
