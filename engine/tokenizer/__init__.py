"""Tokenizers, read from local files and without transformers where possible:
`tokenizer.get_tokenizer` (a LightTokenizer when the directory's tokenizer.json says everything,
else transformers' AutoTokenizer) and `eos_token_ids` (the tokenizer's EOS plus those of
generation_config.json); `light_tokenizer.LightTokenizer` (the `tokenizers` library and a sandboxed
chat template, with transformers' semantics); `gguf_tokenizer.GGUFTokenizer` (a GGUF file's
tokenizer metadata written as tokenizer.json and tokenizer_config.json).
"""
