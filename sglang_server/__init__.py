"""Server side of hsq: the reference server and (later) the dump hook for stock SGLang."""
