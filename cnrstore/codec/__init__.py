"""Row codecs: fingerprints, quantization schemes, qparams, range search, bit-packing."""
