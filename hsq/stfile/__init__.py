"""Raw safetensors I/O for the hot paths, by concern:

- :mod:`hsq.stfile.header`: the one dtype table; building and strictly parsing headers.
- :mod:`hsq.stfile.integrity`: checksums (xxh3, crc32) and NaN/Inf checks on raw bytes.
- :mod:`hsq.stfile.engine`: writing files with the GIL released: from memory (a dump), or
  through a :class:`~hsq.stfile.engine.WriteEngine` that checks and checksums every byte it
  copies (an output).

The files are ordinary safetensors that `safetensors.safe_open` reads.
"""
