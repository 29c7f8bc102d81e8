"""Training losses, one module each (formula and source in each docstring).

Every loss is a plain function of L2-normalised embeddings plus a thin ``torch.nn.Module`` whose
``__init__`` checks its arguments, so the trainer, GradCache and tests call the same code.
"""

from embed_core.losses.cls_infonce import ClassificationInfoNCELoss, classification_infonce
from embed_core.losses.cosent import CoSENTLoss, cosent
from embed_core.losses.codiemb_sts import CoDiEmbSTSLoss, codiemb_sts, pearson_loss, pro_loss, rank_kl_loss
from embed_core.losses.hmcl import HMCLHead, HMCLLoss, hmcl, listmle
from embed_core.losses.infonce import InfoNCELoss, infonce
from embed_core.losses.multi_positive_infonce import MultiPositiveInfoNCELoss, multi_positive_infonce
from embed_core.losses.pair_bce import PairBCELoss, graded_targets, logit_bias, pair_bce, pair_bce_pointwise

from embed_core.config import DEFAULT_LOSSES as LOSSES_BY_TASK  # noqa: E402
from embed_core.config import LOSS_CHOICES as ALTERNATIVE_LOSSES  # noqa: E402

__all__ = ["InfoNCELoss", "infonce", "CoSENTLoss", "cosent", "ClassificationInfoNCELoss",
           "classification_infonce", "LOSSES_BY_TASK", "ALTERNATIVE_LOSSES", "PairBCELoss", "pair_bce",
           "pair_bce_pointwise", "graded_targets", "logit_bias", "HMCLLoss", "HMCLHead", "hmcl", "listmle",
           "MultiPositiveInfoNCELoss", "multi_positive_infonce", "CoDiEmbSTSLoss", "codiemb_sts", "pearson_loss",
           "rank_kl_loss", "pro_loss"]
