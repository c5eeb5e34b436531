"""What the stages share below them: the adapted decoder graph and how it is stored, run and read.

The adapt stage builds `decoder.StaticDecoder` and writes it with `store`; quantize, compile and the Genie
host runner run it through `kv_cache.KVCacheRunner` (Genie's loop: AR-N prefill, AR-1 steps, the cache
outside the graph), in torch or as ONNX through `ort_graph` / `ort_qnn` with the I/O encodings of
`graph_io`; `encodings` reads an exported encodings file, `sqnr` measures weights against it. Nothing here
imports a stage: the stages depend on this package and not on each other.
"""
