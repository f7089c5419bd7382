"""Low precision (chapter 08): number formats, quantization methods and the kernels that read
quantized weights. `formats` is the one implementation of the formats that the KV cache
(kv.quant, chapter 02) and the weights share."""
