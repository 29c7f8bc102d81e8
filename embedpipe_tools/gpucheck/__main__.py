"""``python -m embedpipe_tools.gpucheck [--cpu] [--out FILE] [--steps N]`` (see the package docstring)."""

from embedpipe_tools.gpucheck import main

raise SystemExit(main())
