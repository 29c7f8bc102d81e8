"""Turn Prefect's default Kubernetes base job template into a GPU pool template for the train flow.

    prefect work-pool get-default-base-job-template --type kubernetes > k8s.json   # needs prefect-kubernetes
    python deployments/work-pools/gpu_kubernetes.py k8s.json > gpu.json
    prefect work-pool create gpu --type kubernetes --base-job-template gpu.json --overwrite

Adds three job variables that deployments (``job_variables:`` in prefect.yaml) or single runs can
set: ``gpu_count`` (``nvidia.com/gpu`` limit of the flow-run container, default 1),
``gpu_node_selector`` (e.g. ``{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}``) and
``shm_size_gi`` (a memory-backed /dev/shm; PyTorch data loaders and NCCL need more than the 64 MiB
default). The image must contain embedpipe and a CUDA build of torch (``job_variables.image``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

GPU_VARIABLES = {
    "gpu_count": {"type": "integer", "default": 1, "title": "GPUs", "description": "nvidia.com/gpu limit"},
    "gpu_node_selector": {"type": "object", "default": {}, "title": "GPU node selector",
                          "description": "node labels the flow-run pod must match"},
    "shm_size_gi": {"type": "integer", "default": 16, "title": "/dev/shm (GiB)"},
}


def add_gpu(template: dict[str, Any]) -> dict[str, Any]:
    template["variables"].setdefault("properties", {}).update(GPU_VARIABLES)
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container.setdefault("resources", {}).setdefault("limits", {})["nvidia.com/gpu"] = "{{ gpu_count }}"
    container.setdefault("volumeMounts", []).append({"name": "dshm", "mountPath": "/dev/shm"})
    pod.setdefault("volumes", []).append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                                       "sizeLimit": "{{ shm_size_gi }}Gi"}})
    pod["nodeSelector"] = "{{ gpu_node_selector }}"
    return template


if __name__ == "__main__":
    src = sys.argv[1] if len(sys.argv) > 1 else "-"
    data = json.load(sys.stdin if src == "-" else open(src, encoding="utf-8"))
    json.dump(add_gpu(data), sys.stdout, indent=2)
    print()
