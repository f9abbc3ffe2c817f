"""Hugging Face processors that load without torchvision: Qwen2-VL's and Qwen2.5-VL's.

``AutoProcessor`` builds ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` with a video processor,
and transformers' video processors need torchvision: without it, loading fails with an
``ImportError`` even for a checkpoint that is only ever given images. `load_qwen2_vl_processor`
loads the same processor through the same ``from_pretrained`` path (``AutoImageProcessor``, which
falls back to the PIL image processor, ``AutoTokenizer``, the processor settings and the chat
template), only without the video processor, so text and images become exactly what the full
processor makes of them. A leaf module: it imports nothing but transformers.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

__all__ = ["load_qwen2_vl_processor", "qwen2_vl_processor"]

# Processor class by the checkpoint's ``model_type``.
_QWEN2_VL_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


class _ImagesAndText:
    """Mixin for a processor taking ``(image_processor, tokenizer, video_processor)``: built
    from the first two alone. ``ProcessorMixin`` reads a processor's parts from its ``__init__``
    signature, so without ``video_processor`` there it neither loads nor type-checks one."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


@functools.cache
def _processor_class(model_type: str) -> type:
    """transformers' processor class of ``model_type``, less its video processor. The class keeps
    its name, since ``save_pretrained`` records it as ``processor_class`` for ``AutoProcessor``."""
    import transformers

    if model_type not in _QWEN2_VL_PROCESSORS:
        raise ValueError(f"model_type {model_type!r} is not Qwen2-VL's; expected one of "
                         f"{', '.join(_QWEN2_VL_PROCESSORS)}")
    base = getattr(transformers, _QWEN2_VL_PROCESSORS[model_type])
    return type(base.__name__, (_ImagesAndText, base), {"__module__": __name__,
                                                        "__doc__": base.__doc__})


def qwen2_vl_processor(model_type: str, image_processor: Any, tokenizer: Any,
                       chat_template: str | None = None) -> Any:
    """The ``Qwen2VLProcessor`` (``model_type`` ``"qwen2_vl"``) or ``Qwen2_5_VLProcessor``
    (``"qwen2_5_vl"``) of these parts, without a video processor."""
    return _processor_class(model_type)(image_processor, tokenizer, chat_template=chat_template)


def load_qwen2_vl_processor(model_dir: str | pathlib.Path) -> Any:
    """The ``Qwen2VLProcessor`` (or ``Qwen2_5_VLProcessor``, by the ``model_type`` in
    ``config.json``) of the checkpoint at ``model_dir``, offline and without a video processor.
    A checkpoint of another family is a ``ValueError``."""
    config_file = pathlib.Path(model_dir, "config.json")
    model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    return _processor_class(model_type).from_pretrained(str(model_dir), local_files_only=True)
