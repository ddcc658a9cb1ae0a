"""recloop_kernels: fused multi-table embedding bags with fused sparse optimizers (torch + triton only).

``EmbeddingBagCollection`` (collection.py) is what users hold; the kernels and their torch.library ops
are in embedding_bag.py, the readable PyTorch reference of every op in reference.py. ``DynamicEmbeddingBagCollection``
(dynamic.py) keys tables by raw ids under a row budget (admission, eviction), over the id → slot map of
slot_map.py, with its plain-Python reference in dynamic_reference.py; ``HostCachedEmbeddingBagCollection``
(host_tier.py) keeps whole tables in host memory and their hot rows in a device cache.
"""

from recloop_kernels.collection import EmbeddingBagCollection
from recloop_kernels.config import OptimizerConfig, TableConfig
from recloop_kernels.dynamic import DynamicEmbeddingBagCollection, DynamicTableConfig
from recloop_kernels.host_tier import HostCachedEmbeddingBagCollection

__version__ = "0.1.0"
__all__ = ["DynamicEmbeddingBagCollection", "DynamicTableConfig", "EmbeddingBagCollection",
           "HostCachedEmbeddingBagCollection", "OptimizerConfig", "TableConfig"]
