"""LLaVA: a vision tower, a two-layer projector and a Llama-family decoder."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from mmserve.models import parallel
from mmserve.models.layers import PagedAttention, get_activation
from mmserve.models.llama import LlamaModel
from mmserve.models.vision import VisionTransformer

# One image's encoder input: the processor's named tensors for it alone ("pixel_values":
# [1, 3, H, W]).
EncoderInput = Mapping[str, torch.Tensor]


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config, num_feature_layers: int) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * num_feature_layers,
                                  text_hidden, bias=bias)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; "
                             "supported: 'default' (drop the CLS token), 'full'")
        self.drop_cls = strategy == "default"
        self.vision_tower = VisionTransformer(config.vision_config, self.feature_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(self.feature_layers))
        self.language_model = LlamaModel(config.text_config)


class LlavaForConditionalGeneration(nn.Module):
    """Entry points used by the runner: ``encode_images``, ``embed_tokens``, ``forward``,
    ``compute_logits``."""

    # Checkpoints name the same weights in several layouts (transformers 4.x wrote
    # ``language_model.model.*`` and ``vision_tower.vision_model.*``, 5.x in-memory modules use
    # ``model.language_model.*``); all map onto the names used here.
    checkpoint_renames = (
        (r"^language_model\.model\.", "model.language_model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^(model\.)?vision_tower\.(vision_model\.)?", "model.vision_tower."),
        (r"^multi_modal_projector\.", "model.multi_modal_projector."),
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlavaModel(config)
        text = config.text_config
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False)
                                        or getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = parallel.vocab_parallel_head(text.hidden_size, text.vocab_size)
        self.image_token_id = config.image_token_id
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size

    def skipped_checkpoint_weight(self, name: str) -> bool:
        """Weights in the checkpoint that this model deliberately does not use."""
        tower = self.model.vision_tower
        m = re.match(r"model\.vision_tower\.encoder\.layers\.(\d+)\.", name)
        if m:
            return int(m.group(1)) >= len(tower.encoder.layers)
        if name.startswith(("model.vision_tower.post_layernorm.", "model.vision_tower.head.")):
            return True  # only feed the pooled output, which LLaVA does not use
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True
        return name.endswith("position_ids")

    def attention_layers(self) -> list[PagedAttention]:
        return self.model.language_model.attention_layers()

    def encoder_modules(self) -> list[nn.Module]:
        """The modules that only encode images, so only ever see an image's tokens at a time
        (the CPU runner picks their linear layers' matmul for that)."""
        return [self.model.vision_tower, self.model.multi_modal_projector]

    def encode_images(self, items: list[EncoderInput]) -> list[torch.Tensor]:
        """Each image's ``[tokens_per_image, hidden]`` embeddings; images of one pixel shape
        (all of them, with the processors LLaVA serves) run as one batch."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, item in enumerate(items):
            by_shape.setdefault(tuple(item["pixel_values"].shape), []).append(i)
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for indices in by_shape.values():
            pixels = torch.cat([items[i]["pixel_values"] for i in indices])
            for i, embeds in zip(indices, self.encode_pixels(pixels), strict=True):
                out[i] = embeds
        return out

    def encode_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, 3, H, W]`` -> ``[num_images, tokens_per_image, hidden]``."""
        features = self.model.vision_tower(pixel_values)
        if self.model.drop_cls:
            features = [f[:, 1:] for f in features]
        return self.model.multi_modal_projector(torch.cat(features, dim=-1))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def forward(self, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.model.language_model(positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, as transformers' ``generate`` samples from (and argmax over bfloat16
        is several times slower on the CPU)."""
        if self.tie_word_embeddings:
            logits = hidden @ self.model.language_model.embed_tokens.weight.T
        else:
            logits = self.lm_head(hidden)
        return parallel.gather_vocab(logits, self.vocab_size).float()
