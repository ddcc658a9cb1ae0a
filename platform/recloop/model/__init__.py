"""The ranking model (DLRM-style with a DCNv2 option) over recloop_kernels' embedding collection, and its
training step (compiled, without host synchronization)."""

from recloop.model.fit import StepConfig, TrainStep, default_batch_size, dense_optimizer, fit
from recloop.model.ranking import ModelConfig, RankingModel

__all__ = ["ModelConfig", "RankingModel", "StepConfig", "TrainStep", "default_batch_size", "dense_optimizer", "fit"]
