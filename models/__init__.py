"""Model architectures as plain torch modules, registered by Hugging Face architecture name."""

from mmserve.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]
