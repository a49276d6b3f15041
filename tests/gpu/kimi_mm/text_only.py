"""See the package docstring. Imported inside SGLang's tokenizer manager only."""

from __future__ import annotations

from typing import Any, ClassVar

from sglang.srt.models.kimi_k25 import (
    KimiK25ForConditionalGeneration,
)
from sglang.srt.multimodal.processors.base_processor import (
    BaseMultimodalProcessor,
)


class TextOnlyKimiK25Processor(BaseMultimodalProcessor):  # type: ignore[misc]
    models: ClassVar[list[type]] = [KimiK25ForConditionalGeneration]

    async def process_mm_data_async(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002
        raise ValueError("hsq's live Kimi-K2.5 test sends text-only token ids")
