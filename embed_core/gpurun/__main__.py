"""``python -m embed_core.gpurun [--cpu] [--out DIR] [--budget-s S] [--max-rows N]`` (see the package docstring)."""

from embed_core.gpurun import main

raise SystemExit(main())
