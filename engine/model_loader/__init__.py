"""Loading a model for one rank: `source` resolves what the user named into a local Hugging Face
directory (a directory, a .gguf file, a hub id already in the local cache, or the bundled model of
`default_model`; never a download); `weights` reads safetensors and .bin tensors lazily, each rank
only its slice, dropping each tensor's pages as it moves on; `gguf`, `gguf_file`, `gguf_config` and
`gguf_moe` write a GGUF file's config and tokenizer once and read its tensors in place from a memory
map under Hugging Face names, quantized ones kept in their blocks; `loader.load_model` builds this
rank's model class and fills it through its layers' weight loaders.
"""
