"""Text in and out of a model: encoding, decoding and chat templates through a
Hugging Face tokenizer, shared by every backend (`model.hf`, `model.mlx`) so a prompt
becomes the same token ids whichever backend computes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.errors import ImagePromptError, ModelNotSupportedError, PromptTooLongError
from pagedkv.model.token_bound import fewest_tokens

if TYPE_CHECKING:
    from pagedkv.model.vision import ImagePrompt, VisionModel


class TextMethods:
    """The text side of a backend. A class using it sets `tokenizer` (a transformers
    tokenizer), `name`, `max_token_chars` (`model.token_bound.max_chars_per_token`)
    and `vision` (a `model.vision.VisionModel`, or None for a text-only model)."""

    tokenizer: Any
    name: str
    max_token_chars: int | None
    vision: VisionModel | None

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of plain text, with the special tokens the tokenizer adds by default
        (a BOS for Llama-style tokenizers, nothing for ChatML-style ones). A text that
        cannot fit `max_tokens` tokens is refused before it is tokenized."""
        self.check_length(text, max_tokens)
        return list(self.tokenizer.encode(text))

    def check_length(self, text: str, max_tokens: int | None) -> None:
        """Raise PromptTooLongError when `text` is more characters than `max_tokens`
        tokens can cover (never where the tokenizer gives no bound)."""
        per_token = self.max_token_chars
        if max_tokens is None or per_token is None or len(text) <= max_tokens * per_token:
            return
        raise PromptTooLongError(len(text), fewest_tokens(len(text), per_token), max_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation in the model's chat template, generation prompt
        added unless asked not to; refused before tokenizing when the rendered text
        cannot fit `max_tokens` tokens."""
        if self.vision is not None:
            prompt = self.render_chat(messages, add_generation_prompt, max_tokens, **kwargs)
            if prompt.images:
                raise ImagePromptError(
                    "this path renders text only; send a conversation with images "
                    "through render_chat, which returns their spans"
                )
            return prompt.token_ids
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ModelNotSupportedError(
                f"model {self.name} has no chat template; send plain text prompts instead"
            )
        # Rendered, then tokenized as apply_chat_template(tokenize=True) does (no added
        # special tokens: the template wrote them), so a text too long is refused first.
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        self.check_length(text, max_tokens)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        **kwargs: Any,
    ) -> ImagePrompt:
        """A conversation whose messages may hold image parts, through the processor
        (`VisionModel.render`): ids with each image's placeholder tokens, and the
        images' spans. A model without images refuses image parts."""
        if self.vision is None:
            raise ImagePromptError(f"model {self.name} takes no images; send text content only")
        return self.vision.render(
            messages,
            add_generation_prompt,
            check=lambda text: self.check_length(text, max_tokens),
            **kwargs,
        )
