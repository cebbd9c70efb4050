"""llama.cpp's GGUF files in: config, tensors (dequantised through the `gguf` package) and tokenizer, mapped onto the
families. Sits above the families and below auto, which takes transformers' ``gguf_file=`` argument."""
