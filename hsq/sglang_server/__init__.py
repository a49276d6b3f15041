"""Server side of hsq: the reference server (reference/) and the dump hook for stock
SGLang (sglang_hook/)."""
