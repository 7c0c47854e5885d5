"""dsaquant: one set of bytes for the DeepSeek Sparse Attention indexer on every GPU."""
__version__ = "0.1.0"
from . import formats  # noqa: F401
