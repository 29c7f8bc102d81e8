"""``python -m embed_core.gpucheck [--cpu] [--out FILE] [--steps N]`` (see the package docstring)."""

from embed_core.gpucheck import main

raise SystemExit(main())
