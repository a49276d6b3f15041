"""A text-only multimodal processor for the live Kimi-K2.5 test, loaded by SGLang through
SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=tests.gpu.kimi_mm (it replaces SGLang's Kimi
processor, which reads fields of Kimi's remote-code processor that a random checkpoint
does not have). Requests carry token ids only, so it is never asked to process media."""
