"""The ranking model (DLRM-style with a DCNv2 option) over recloop_kernels' embedding collection."""

from recloop.model.ranking import ModelConfig, RankingModel

__all__ = ["ModelConfig", "RankingModel"]
