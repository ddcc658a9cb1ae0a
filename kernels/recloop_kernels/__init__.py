"""recloop_kernels: fused multi-table embedding bags with fused sparse optimizers (torch + triton only).

``EmbeddingBagCollection`` (collection.py) is what users hold; the kernels and their torch.library ops
are in embedding_bag.py, the readable PyTorch reference of every op in reference.py.
"""

from recloop_kernels.collection import EmbeddingBagCollection
from recloop_kernels.config import OptimizerConfig, TableConfig

__version__ = "0.1.0"
__all__ = ["EmbeddingBagCollection", "OptimizerConfig", "TableConfig"]
