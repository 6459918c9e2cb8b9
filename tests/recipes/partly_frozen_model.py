"""A model builder for tests: the tiny Llama2 with some of its modules frozen, as a
builder like ``llama3_2_vision_11b(decoder_trainable=False)`` freezes part of a model.

Point a config at it with ``model._component_=tests.recipes.partly_frozen_model.
partly_frozen_llama2`` and ``model.frozen=[tok_embeddings,layers.0]``.
"""

from torchtune.models.llama2 import llama2
from torchtune.modules import TransformerDecoder


def partly_frozen_llama2(frozen: list[str], **llama2_kwargs) -> TransformerDecoder:
    """``llama2(**llama2_kwargs)`` with every parameter of the modules named in
    ``frozen`` (e.g. ``"tok_embeddings"``, ``"layers.0"``) set to
    ``requires_grad=False``.
    """
    model = llama2(**llama2_kwargs)
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    return model
