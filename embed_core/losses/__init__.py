"""Training losses, one module each (formula and source in each docstring).

Every loss is a plain function of L2-normalised embeddings plus a thin ``torch.nn.Module`` whose
``__init__`` checks its arguments, so the trainer, GradCache and tests call the same code.
"""

from embed_core.losses.cls_infonce import ClassificationInfoNCELoss, classification_infonce
from embed_core.losses.cosent import CoSENTLoss, cosent
from embed_core.losses.infonce import InfoNCELoss, infonce

LOSSES_BY_TASK = {"retrieval": "infonce", "classification": "cls_infonce", "sts": "cosent", "nli": "cosent",
                  "pair_classification": "cosent"}

__all__ = ["InfoNCELoss", "infonce", "CoSENTLoss", "cosent", "ClassificationInfoNCELoss",
           "classification_infonce", "LOSSES_BY_TASK"]
