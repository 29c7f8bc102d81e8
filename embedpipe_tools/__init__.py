"""Programs that drive embedpipe from outside the library: the GPU check (``python -m
embedpipe_tools.gpucheck``, ``make gpu-check``) and a GPU reservation's runs (``python -m
embedpipe_tools.gpurun``, ``make gpu-run``; the first-run kit, ``make gpu-first``). They import
``embed_core``; the library never imports them."""
